"""How the CPU kernels are chosen and shown: the variant from cpuid (never one the CPU lacks,
whatever the cache holds), overrides that are checked, one OpenMP runtime shared with torch, and
`mm-engine env`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mm_engine.kernels import cpu_build, cpu_elementwise, cpu_kernels


def test_features_come_from_cpuid_and_pick_the_widest_variant_the_cpu_runs(monkeypatch):
    monkeypatch.delenv("MM_ENGINE_CPU_VARIANT", raising=False)
    features = cpu_build.cpu_features()
    assert all(
        cpu_build.supported(v) == (set(cpu_build.VARIANTS[v].needs) <= features) for v in cpu_build.VARIANTS
    )
    best = cpu_build.best_variant()
    assert cpu_build.supported(best)
    assert all(
        not cpu_build.supported(v) for v in list(cpu_build.VARIANTS)[: list(cpu_build.VARIANTS).index(best)]
    )


def test_a_variant_the_cpu_lacks_is_never_loaded(monkeypatch):
    """Whatever sits in the build cache, a library is loaded only where cpuid shows every
    feature it was compiled for: an illegal instruction cannot be reached."""
    monkeypatch.setattr(cpu_build, "_features", frozenset())  # a CPU with nothing past the baseline
    monkeypatch.setattr(cpu_build, "_libs", {})
    monkeypatch.delenv("MM_ENGINE_CPU_VARIANT", raising=False)
    if "avx512" in cpu_build.VARIANTS:
        assert cpu_build.load("avx512") is None and cpu_build.load("avx2") is None
        assert "avx512f" in cpu_build.status()["errors"]["avx512"]
    assert cpu_build.best_variant() == "portable"
    assert cpu_build.load() is not None  # the portable library runs anywhere
    monkeypatch.setenv("MM_ENGINE_CPU_VARIANT", "avx2")
    if "avx2" in cpu_build.VARIANTS:
        with pytest.raises(ValueError, match="cpu_kernel_variant avx2: this CPU lacks avx, avx2, fma"):
            cpu_build.best_variant()


def test_overrides_are_checked(monkeypatch):
    monkeypatch.setenv("MM_ENGINE_CPU_VARIANT", "sse9")
    with pytest.raises(ValueError, match="cpu_kernel_variant must be one of"):
        cpu_build.best_variant()
    monkeypatch.delenv("MM_ENGINE_CPU_VARIANT")
    with pytest.raises(ValueError, match="cpu_kernel_variant must be one of"):
        cpu_build.best_variant("sse9")  # the engine argument, checked the same way
    with pytest.raises(ValueError, match=r"unknown CPU kernel\(s\) \['bogus'\]"):
        cpu_kernels.select(kernels="decode,bogus")
    assert cpu_kernels.select(kernels="none") is None
    chosen = cpu_kernels.select(kernels="decode, gemm")
    assert chosen is not None and chosen.enabled == {"decode", "gemm"}
    measured = cpu_kernels.select(kernels="measured")
    assert measured is not None and measured.enabled == cpu_kernels.MEASURED_FASTER[measured.variant]


def test_the_kernels_run_on_torchs_threads(cpu_lib):
    """One OpenMP runtime in the process (torch's), and no thread beyond torch's pool after the
    kernels ran: torch.set_num_threads governs both, nothing oversubscribes the cores."""
    x = torch.randn(512, 4096)
    torch.nn.functional.gelu(x)  # torch's own parallel region: its pool exists
    before = len(os.listdir("/proc/self/task"))
    for _ in range(3):
        assert cpu_elementwise.gelu_tanh_(cpu_lib, x)
        torch.nn.functional.gelu(x)
    assert len(os.listdir("/proc/self/task")) <= before
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "/libgomp" in line or "/libiomp5" in line}
    assert len(runtimes) == 1, runtimes


def test_mm_engine_env_prints_the_platform(capsys):
    from mm_engine.cli import main

    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["torch"] == torch.__version__ and env["compiler"]
    assert env["variant"] == cpu_build.best_variant() and env["variant"] in env["variants_supported"]
    assert set(env["kernels"]) == cpu_kernels.MEASURED_FASTER[env["variant"]]
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "variant" in text and env["variant"] in text and "openmp_runtime" in text


def test_without_a_compiler_nothing_loads_and_status_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MM_ENGINE_CACHE", str(tmp_path / "cache"))  # nothing cached to fall back on
    monkeypatch.delenv("MM_ENGINE_CPU_VARIANT", raising=False)
    monkeypatch.setattr(cpu_build, "_libs", {})
    monkeypatch.setattr(cpu_build, "_errors", {})
    monkeypatch.setattr(cpu_build, "_features", None)
    assert cpu_kernels.select() is None
    errors = cpu_build.status()["errors"]
    assert "no C compiler" in errors["probe"] and "no C compiler" in errors["portable"]
