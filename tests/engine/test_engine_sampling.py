"""Sampling and output semantics through the engine: seeds, stops, lengths, text, metrics."""

from __future__ import annotations

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams

PROMPT = {
    "prompt": "USER: <image> describe this picture ASSISTANT:",
    "multi_modal_data": {"image": make_image(3)},
}
TEXT_PROMPTS = [
    "USER: what color is the circle ASSISTANT:",
    "USER: how many ASSISTANT:",
    "USER: tell me ASSISTANT:",
]


@pytest.fixture(scope="module")
def llm(clip_llama):
    return LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (3, 9, 15)]
    batch = llm.generate([*TEXT_PROMPTS, PROMPT], [*others, sp])
    assert batch[-1].outputs[0].token_ids == alone
    first = llm.generate([PROMPT, *TEXT_PROMPTS], [sp, *others])
    assert first[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    draws = {tuple(llm.generate(PROMPT, other_seed)[0].outputs[0].token_ids) for _ in range(2)}
    assert len(draws) == 1  # same seed, same draw; and a different seed gives different tokens
    assert draws != {tuple(alone)}


def test_max_tokens_finishes_with_length_and_text_matches_tokens(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length"
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_stop_token_ids_and_eos(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_at = base.token_ids[2]
    first = base.token_ids.index(stop_at)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[
        0
    ].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # Treat the first greedy token as end-of-sequence: ignore_eos decides whether it ends the request.
    engine = llm.engine
    saved = engine.frontend.eos_token_ids
    engine.frontend.eos_token_ids = frozenset({base.token_ids[0]})
    try:
        eos = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
        assert eos.token_ids == base.token_ids[:1] and eos.finish_reason == "stop" and eos.stop_reason is None
        ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[
            0
        ].outputs[0]
        assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    finally:
        engine.frontend.eos_token_ids = saved


def test_stop_strings(llm):
    # A random model may babble special tokens only; pick an image whose answer has words.
    for seed in range(20):
        prompt = {**PROMPT, "multi_modal_data": {"image": make_image(seed)}}
        base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[
            0
        ]
        words = base.text.split()
        if len(set(words)) >= 3:
            break
    assert len(set(words)) >= 3, base
    stop = next(w for w in words[1:] if w != words[0])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == base.text[: base.text.index(stop)]
    kept = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]


def test_max_model_len_caps_generation(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, max_model_len=24)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24
    assert out.outputs[0].finish_reason == "length"
