"""Bad input raises a ValueError naming the problem, leaves nothing allocated, and the engine keeps
serving."""

from __future__ import annotations

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(clip_llama):
    return LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, max_model_len=64)


def _assert_nothing_held(llm):
    report = llm.kv_report()
    for pool in ("text", "image"):
        assert report[pool]["used_blocks"] == 0
    assert not llm.engine.core.scheduler.waiting and not llm.engine.core.scheduler.running
    assert not llm.engine.core.requests


GOOD = {"prompt": "USER: <image> what is this ASSISTANT:", "multi_modal_data": {"image": make_image(1)}}


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("USER: " + "what " * 80 + "ASSISTANT:", SamplingParams(), "longer than max_model_len"),
        (
            {"prompt": "USER: <image> <image> what ASSISTANT:", "multi_modal_data": {"image": make_image(1)}},
            SamplingParams(),
            "2 image placeholder",
        ),
        (
            {"prompt": "USER: what ASSISTANT:", "multi_modal_data": {"image": [make_image(1)]}},
            SamplingParams(),
            "0 image",
        ),
        (
            {"prompt": "USER: <image> what ASSISTANT:", "multi_modal_data": {"image": b"not an image"}},
            None,
            "image 0",
        ),
        ({"prompt": "USER: <image> what ASSISTANT:", "multi_modal_data": {"image": 42}}, None, "got int"),
        (
            {"prompt": "USER: <image> what ASSISTANT:", "multi_modal_data": {"video": 1}},
            None,
            "does not read video",
        ),
        (
            {"prompt": "USER: <image> what ASSISTANT:", "multi_modal_data": {"audio": 1}},
            None,
            "'image' and 'video'",
        ),
        ({"prompt_token_ids": []}, None, "empty"),
        (12, None, "must be a string or a dict"),
    ],
)
def test_bad_prompt_raises_and_leaks_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD, prompt], params or SamplingParams(max_tokens=2))
    _assert_nothing_held(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
    ],
)
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_are_checked_at_submit(llm):
    sp = SamplingParams(max_tokens=4)
    sp.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(GOOD, sp)
    _assert_nothing_held(llm)


def test_engine_serves_after_errors(llm):
    for bad in (b"\x89PNG\r\n\x1a\n truncated", b"\xff\xd8\xff\xe0 truncated jpeg"):
        with pytest.raises(ValueError):
            llm.generate({"prompt": "USER: <image> a ASSISTANT:", "multi_modal_data": {"image": bad}})
    out = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.finished and len(out.outputs[0].token_ids) >= 1
    _assert_nothing_held(llm)


def test_bad_engine_arguments(clip_llama):
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(clip_llama, no_such_option=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(clip_llama, block_size=12)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(clip_llama, attention_backend="cuda-magic")
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(clip_llama, scheduling_policy="random")
    with pytest.raises(ValueError, match="image_pool_fraction"):
        LLM(clip_llama, image_pool_fraction=1.5)


def test_list_lengths_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate([GOOD, GOOD], [SamplingParams()])
    _assert_nothing_held(llm)
