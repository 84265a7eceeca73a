"""bench.kernels runs end to end on a small grid (under the Triton interpreter on CPU, compiled with
MM_ENGINE_TEST_DEVICE=cuda): every row has its figures, and the engine-layout and slot-major caches
hold the same values. No timing is checked."""

from __future__ import annotations

import json

import torch

from bench import kernels
from helpers.device import TEST_DEVICE


def test_kernel_bench_small_grid(monkeypatch, capsys, tmp_path):
    # Few repetitions: under the interpreter each call takes tens of milliseconds.
    fast = kernels.time_ms
    monkeypatch.setattr(kernels, "time_ms", lambda fn, device, **_: fast(fn, device, warmup=1, iters=2))
    shape = kernels.Shape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    results = kernels.run(TEST_DEVICE, shape, [(2, 40)], [(1, 24)], copy_bytes=1 << 20)

    (decode,), (prefill,) = results["decode"], results["prefill"]
    for name in ("triton", "triton_nosplit", "triton_slot_major", "sdpa"):
        assert decode[f"{name}_ms"] > 0 and decode[f"{name}_bw_frac"] > 0
    for name in ("triton", "triton_slot_major", "sdpa", "triton_window", "sdpa_window", "triton_images"):
        assert prefill[f"{name}_ms"] > 0 and prefill[f"{name}_tflops"] > 0
    assert decode["num_splits"] >= 1 and results["copy_bandwidth_gbs"] > 0
    json.dumps(results)  # what main writes
    kernels.print_tables(results)
    assert "decode (fraction of copy bandwidth)" in capsys.readouterr().out


def test_case_layouts_hold_the_same_values():
    shape = kernels.Shape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    case = kernels.make_case(3, 1, 50, shape, TEST_DEVICE)
    # The engine's cache is a head-major tensor seen through a transposed view.
    assert case.k_cache.stride(2) == shape.block_size * shape.head_dim
    assert case.k_slot_major.is_contiguous()
    assert torch.equal(case.k_cache, case.k_slot_major) and torch.equal(case.v_cache, case.v_slot_major)
    # The dense copies SDPA reads are the first 50 tokens of each sequence, in table order.
    table = case.meta.block_tables[1].long()
    first_block = case.k_cache[table[0]]  # [slot, kv_head, dim]
    assert torch.equal(case.k_dense[1, :, :16], first_block.transpose(0, 1))


def test_cpu_kernel_bench_runs_every_kernel_against_its_twin(capsys):
    """bench.kernels_cpu on tiny shapes in this process: a row per kernel and shape, each with
    both sides' figures and a verdict per kernel. No timing is checked."""
    from bench import kernels_cpu
    from mm_engine.kernels.cpu_kernels import KERNELS

    res = kernels_cpu.run_variant(quick=True, budget_s=0.004, rounds=1)
    assert {r["kernel"] for r in res["rows"]} == set(KERNELS)
    assert all(r["c_ms"] > 0 and r["torch_ms"] > 0 for r in res["rows"])
    res["verdict"] = kernels_cpu.verdict(res["rows"])
    assert set(res["verdict"]) == set(KERNELS)
    kernels_cpu.print_table({"cpu": "x", "torch": torch.__version__, "threads": 2, "variants": {"v": res}})
    assert "-> gemm" in capsys.readouterr().out
    json.dumps(res)


@torch.inference_mode()
def test_qgemm_stream_bench_times_every_kind_and_row_count(cpu_lib):
    from bench import qgemm_stream

    shapes = ((48, 32), (32, 64))
    for kind in ("int8", "int4", "bf16"):
        rows = qgemm_stream.stream(kind, 2, [1, 3], 1, {"this": cpu_lib, "other": cpu_lib}, shapes)
        assert [(r["build"], r["rows"]) for r in rows] == [
            ("this", 1),
            ("other", 1),
            ("this", 3),
            ("other", 3),
        ]
        per_weight = {"int8": 1, "int4": 0.5, "bf16": 2}[kind]  # the panels pad N to whole panels
        assert all(r["bytes"] >= 2 * per_weight * (48 * 32 + 32 * 64) and r["ms"] > 0 for r in rows)
