"""Reuse of image KV (prefix caching) and of encoder outputs, counted rather than timed."""

from __future__ import annotations

import time

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams

KV = 8 * 1024**2
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def ask(seed: int, question: str) -> dict:
    return {"prompt": f"USER: <image> {question} ASSISTANT:", "multi_modal_data": {"image": make_image(seed)}}


def run_counting(llm: LLM, prompt: dict) -> tuple[list[int], int, int]:
    """(tokens, cached prompt tokens, prompt tokens that this request's prefill computed)."""
    engine = llm.engine
    rid = engine.add_request(prompt, GREEDY)
    req = engine.core.requests[rid]
    computed_prefill = 0
    schedule = engine.core.scheduler.schedule
    while engine.has_unfinished():
        batch = schedule(time.time())
        for r, n in batch.items:  # what the runner is given to compute: counted, not timed
            if r is req and r.num_computed_tokens < r.num_prompt_tokens:
                computed_prefill += min(n, r.num_prompt_tokens - r.num_computed_tokens)
        engine.core.scheduler.schedule = lambda now, held=frozenset(), b=batch: b
        try:
            outs = engine.step()
        finally:
            engine.core.scheduler.schedule = schedule
        final = [o for o in outs if o.finished]
    return final[0].outputs[0].token_ids, final[0].num_cached_tokens, computed_prefill


def test_second_question_about_the_same_image_reuses_its_kv(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, block_size=8)
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV, block_size=8, enable_prefix_caching=False)
    first, cached, computed = run_counting(llm, ask(1, "what is this"))
    assert cached == 0
    encoded = llm.engine.core.runner.num_encoded_images
    q2 = ask(1, "what color is the circle")
    second, cached, computed = run_counting(llm, q2)
    n_prompt = len(llm.generate(q2, GREEDY)[0].prompt_token_ids)
    # "USER:" + 16 image tokens: blocks [0, 8) and [8, 16) are shared; the rest is new.
    assert cached == 16
    assert computed == n_prompt - cached
    assert (
        llm.engine.core.runner.num_encoded_images == encoded
    )  # the last image token came from the encoder cache
    assert second == plain.generate(q2, GREEDY)[0].outputs[0].token_ids
    report = llm.kv_report()
    assert report["image"]["prefix_cache_hits"] >= 1 and report["text"]["prefix_cache_hits"] >= 1
    assert report["encoder_cache"]["hits"] >= 1


def test_different_images_never_share_kv(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, block_size=8)
    run_counting(llm, ask(1, "what is this"))
    tokens, cached, _ = run_counting(llm, ask(2, "what is this"))
    assert cached == 0  # same placeholder tokens, different pixels
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV, enable_prefix_caching=False)
    assert tokens == plain.generate(ask(2, "what is this"), GREEDY)[0].outputs[0].token_ids


def test_repeated_image_is_encoded_once_while_cached(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, enable_prefix_caching=False)
    prompts = [ask(5, q) for q in ("what is this", "how many shapes", "describe this picture")]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.core.runner.num_encoded_images == 1
    llm.generate(ask(5, "tell me"), GREEDY)
    assert llm.engine.core.runner.num_encoded_images == 1
    fresh = LLM(clip_llama, kv_cache_memory_bytes=KV, enable_prefix_caching=False, encoder_cache_bytes=1)
    with pytest.raises(ValueError, match="larger than the encoder cache"):
        fresh.generate(ask(5, "tell me"), GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        alone = LLM(clip_llama, kv_cache_memory_bytes=KV).generate(p, GREEDY)[0]
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids


def test_encoder_cache_evicts_least_recently_used(clip_llama):
    # One image's features: 16 tokens x 128 dims x 4 bytes = 8 KiB; room for two.
    llm = LLM(
        clip_llama, kv_cache_memory_bytes=KV, enable_prefix_caching=False, encoder_cache_bytes=16 * 1024
    )
    for seed in (1, 2, 3):
        llm.generate(ask(seed, "what"), GREEDY)
    assert llm.engine.core.runner.num_encoded_images == 3
    llm.generate(ask(3, "what"), GREEDY)  # still cached
    assert llm.engine.core.runner.num_encoded_images == 3
    llm.generate(ask(1, "what"), GREEDY)  # evicted by 3
    assert llm.engine.core.runner.num_encoded_images == 4
    assert llm.kv_report()["encoder_cache"]["evictions"] >= 1


def test_chunk_stops_before_an_image_the_encoder_budget_cannot_take(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_encoder_tokens=16, enable_prefix_caching=False)
    engine = llm.engine
    prompt = {
        "prompt": "USER: <image> and <image> which ASSISTANT:",
        "multi_modal_data": {"image": [make_image(7), make_image(8)]},
    }
    rid = engine.add_request(prompt, GREEDY)
    req = engine.core.requests[rid]
    engine.step()
    assert req.num_computed_tokens == req.images[1].offset  # stopped right before the second image
    assert engine.core.runner.num_encoded_images == 1
    while engine.has_unfinished():
        outs = engine.step()
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV)
    assert outs[0].outputs[0].token_ids == plain.generate(prompt, GREEDY)[0].outputs[0].token_ids


def test_questions_sent_together_compute_their_shared_image_prefix_once(clip_llama):
    """Four questions about one picture, arriving at once: the first prefills the image, the
    others wait one step for those blocks and compute only their own words; the answers are those
    of each question alone."""
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, block_size=8)
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV, block_size=8, enable_prefix_caching=False)
    questions = ["what is this", "what color is the circle", "how many are there", "describe the image"]
    prompts = [ask(3, q) for q in questions] + [ask(4, "what is this")]  # and another picture
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outs = {o.request_id: o for o in engine.step() if o.finished}
    # The first question and the other picture start; the other questions wait for the image blocks.
    assert {r.request_id for r in engine.core.scheduler.running} == {ids[0], ids[4]}
    assert {r.request_id for r in engine.core.scheduler.waiting} == set(ids[1:4])
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    for rid in ids[1:4]:
        assert outs[rid].num_cached_tokens == 16  # "USER:" and the 16 image tokens, in two blocks
    assert outs[ids[0]].num_cached_tokens == 0 and outs[ids[4]].num_cached_tokens == 0
    alone = plain.generate(prompts, GREEDY)
    assert [outs[rid].outputs[0].token_ids for rid in ids] == [o.outputs[0].token_ids for o in alone]
    assert all(p.num_used == 0 for p in engine.core.blocks.pools.values())
