"""Shared fixtures: tiny random LLaVA checkpoints built once per session, and the transformers
reference that every engine output is compared with."""

from __future__ import annotations

import os

# The Triton tests run on CPU tensors under the interpreter. On a machine with a GPU,
# MM_ENGINE_TEST_DEVICE=cuda runs them compiled on the device instead (the rest of the suite stays
# on CPU). The interpreter must be chosen before triton is first imported.
if os.environ.get("MM_ENGINE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.reference import FamilyReference, Reference  # noqa: E402
from mm_engine.testing import build_checkpoint  # noqa: E402

# Every xdist worker gets its share of the CPUs: more threads than cores makes OpenMP's workers
# spin against each other (two workers of two threads on two cores: 1.65x the wall time).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)) // _workers)))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per CPU this process may use, at most eight
    (each worker builds its own session checkpoints, so more stop paying)."""
    return min(len(os.sched_getaffinity(0)), 8)


@pytest.fixture(scope="session")
def clip_llama(tmp_path_factory) -> str:
    return str(build_checkpoint("llava", tmp_path_factory.mktemp("clip_llama"), vision="clip", text="llama"))


@pytest.fixture(scope="session")
def siglip_qwen2(tmp_path_factory) -> str:
    return str(
        build_checkpoint("llava", tmp_path_factory.mktemp("siglip_qwen2"), vision="siglip", text="qwen2")
    )


@pytest.fixture(scope="session")
def ref_clip_llama(clip_llama) -> Reference:
    return Reference(clip_llama)


@pytest.fixture(scope="session")
def ref_siglip_qwen2(siglip_qwen2) -> Reference:
    return Reference(siglip_qwen2)


def _build_family(name: str, path):
    # SmolVLM shares Idefics3's architecture: a seed of its own gives it weights of its own
    # (GLM-4.6V likewise shares GLM-4.1V's.)
    return build_checkpoint(name, path, **({"seed": 1} if name in ("smolvlm", "glm46v") else {}))


@pytest.fixture(scope="session")
def vl_family(tmp_path_factory):
    """`vl_family(name)`: a tiny checkpoint of that family (qwen2_vl, qwen2_5_vl, qwen3_vl,
    idefics3, smolvlm, internvl, internvl_qwen3, mistral3, llava_next, llava_onevision, gemma3), built
    once per session, and its transformers
    reference."""
    built: dict[str, tuple[str, FamilyReference]] = {}

    def get(name: str) -> tuple[str, FamilyReference]:
        if name not in built:
            path = str(_build_family(name, tmp_path_factory.mktemp(name)))
            built[name] = (path, FamilyReference(path))
        return built[name]

    return get


def _variant_params():
    from mm_engine.kernels import cpu_build

    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not cpu_build.supported(name), reason=f"this CPU lacks {cpu_build.why_unsupported(name)}"
            ),
        )
        for name in cpu_build.VARIANTS
    ]


@pytest.fixture(params=_variant_params())
def cpu_variant(request) -> str:
    """Each ISA variant of the C kernels this CPU runs (avx512, avx2, portable on x86-64); the
    others are skipped with the features the CPU lacks."""
    return request.param


@pytest.fixture
def cpu_lib(cpu_variant):
    from mm_engine.kernels import cpu_build

    lib = cpu_build.load(cpu_variant)
    assert lib is not None, f"the {cpu_variant} kernels must build where the tests run: {cpu_build.status()}"
    return lib


@pytest.fixture
def cpu_kernels(cpu_variant, cpu_lib):
    """Every C kernel of one variant enabled, whatever the measured table says."""
    from mm_engine.kernels.cpu_kernels import KERNELS, CpuKernels

    return CpuKernels(cpu_variant, cpu_lib, frozenset(KERNELS))


def pytest_collection_modifyitems(config, items) -> None:
    """Files with the most `slow` tests first (each file's own order kept): under xdist the long
    tests then start early and the short ones fill the workers' gaps at the end, instead of one
    worker finishing a minute-long test while the other waits."""
    weight: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        path = str(item.path)
        weight[path] = weight.get(path, 0) + bool(item.get_closest_marker("slow"))
        first_seen.setdefault(path, i)
    items.sort(key=lambda item: (-weight[str(item.path)], first_seen[str(item.path)]))
