"""What the family tests share: an engine with small blocks and a step budget that splits image
runs across chunks, greedy sampling, multimodal prompts, and the no-leak check."""

from __future__ import annotations

from conftest import TEST_DEVICE

from mm_engine import LLM, SamplingParams


def mm(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def engine(path: str, backend: str = "auto", **kwargs) -> LLM:
    args = dict(kv_cache_memory_bytes=8 * 1024**2, block_size=8, max_num_batched_tokens=16)
    if backend == "triton":  # interpreted on CPU tensors, or compiled on a GPU, in float32
        args.update(device=TEST_DEVICE.type, dtype="float32", vision_dtype="float32")
    return LLM(path, attention_backend=backend, **{**args, **kwargs})


def assert_all_free(llm: LLM) -> None:
    report = llm.kv_report()
    for pool in ("text", "image"):
        assert report[pool]["used_blocks"] == 0
        assert report[pool]["free_blocks"] + report[pool]["cached_blocks"] == report[pool]["total_blocks"]
