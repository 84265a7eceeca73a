"""End to end: the engine on the Triton backend (interpreted on CPU) gives transformers' tokens."""

from __future__ import annotations

import os

import pytest
from conftest import make_image

from mm_engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs the Triton interpreter (tests/conftest.py sets it)",
)


def test_triton_backend_matches_transformers(siglip_qwen2, ref_siglip_qwen2):
    llm = LLM(
        siglip_qwen2, attention_backend="triton", kv_cache_memory_bytes=4 * 1024**2, max_num_batched_tokens=16
    )
    assert llm.engine.runner.backend.name == "triton"
    cases = [
        ("USER: <image> what is this ASSISTANT:", [make_image(1)], 6),
        ("USER: <image> and <image> which is left ASSISTANT:", [make_image(2, (20, 50)), make_image(3)], 5),
        ("USER: how many shapes are there ASSISTANT:", [], 7),
    ]
    outs = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs, _ in cases],
        [SamplingParams(temperature=0, max_tokens=n) for _, _, n in cases],
    )
    for out, (prompt, imgs, n) in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == ref_siglip_qwen2.generate(prompt, imgs, n), prompt
    report = llm.kv_report()
    assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0


def test_triton_without_cuda_or_interpreter_says_so(clip_llama, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(clip_llama, attention_backend="triton", device="cpu")
