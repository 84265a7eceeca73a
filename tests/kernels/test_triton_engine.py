"""End to end: the engine on the Triton backend (interpreted on CPU, or on the GPU with
MM_ENGINE_TEST_DEVICE=cuda, in float32 there too) gives transformers' tokens."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.device import TEST_DEVICE
from helpers.images import make_image
from mm_engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and TEST_DEVICE.type != "cuda",
    reason="needs the Triton interpreter (tests/conftest.py sets it) or MM_ENGINE_TEST_DEVICE=cuda",
)


def test_triton_backend_matches_transformers(siglip_qwen2, ref_siglip_qwen2, monkeypatch):
    # The reference runs in float32 on the CPU; on a GPU, cuDNN's TF32 convolutions (the patch
    # embedding) would round differently enough to flip a random model's near-tied tokens.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    llm = LLM(
        siglip_qwen2,
        attention_backend="triton",
        kv_cache_memory_bytes=4 * 1024**2,
        max_num_batched_tokens=16,
        device=TEST_DEVICE.type,
        dtype="float32",
        vision_dtype="float32",
    )
    assert llm.engine.core.runner.backend.name == "triton"
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
