"""Steps of background work alone (Batch API requests, nothing foreground to run): an image is
encoded in a step of its own, with the prompt only up to its first token, and its run is prefilled
in a later step, so that no background step both encodes and prefills (a request that arrives
meanwhile waits for the one in flight). Steps that run foreground work are unchanged."""

from __future__ import annotations

import torch

from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.request import ImageSpan, Request
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import PriorityPolicy
from mm_engine.sched.scheduler import Scheduler
from mm_engine.vision.encoder_cache import EncoderCache

BS, IMG_ID, EMBEDS = 16, 99, 30
BACKGROUND = 10


def _scheduler(whole_images: bool = False, prefill_tokens: int = 256) -> Scheduler:
    blocks = BlockManager(BlockPool(TEXT, 0, 400), BlockPool(IMAGE, 400, 100), BS, True, 0.0)
    policy = PriorityPolicy(
        image_priority_boost=0.5, max_wait_s=1000.0, preemption_margin=1.0, background_priority=BACKGROUND
    )
    return Scheduler(
        blocks, policy, 64, 4096, EncoderCache(10**9), 4096, whole_images=whole_images,
        background_prefill_tokens=prefill_tokens,
    )  # fmt: skip


def _request(rid: int, priority: int, words: int = 20, image: bool = True) -> Request:
    spans = [ImageSpan(3, EMBEDS, torch.zeros(1), f"img{rid}")] if image else []
    ids = [1, 2, 3] + [IMG_ID] * (EMBEDS if image else 0) + [5] * words
    params = SamplingParams(max_tokens=50)
    return Request(str(rid), ids, spans, params, float(rid), rid, frozenset(), priority=priority)


def _run(sched: Scheduler, now: float) -> list:
    """Schedule a step and settle it as the core would; returns (batch, {request id: tokens})."""
    batch = sched.schedule(now)
    for req, n in batch.items:
        req.num_computed_tokens += n
        if req.num_computed_tokens >= req.num_prompt_tokens:
            req.token_ids.append(7)
    return batch, {req.request_id: n for req, n in batch.items}


def test_a_background_image_is_encoded_in_a_step_of_its_own_then_prefilled():
    sched = _scheduler()
    sched.add(_request(0, BACKGROUND))
    batch, took = _run(sched, 0.0)
    assert batch.background_only
    assert took == {"0": 4} and batch.encoder_tokens == EMBEDS  # the text before it and its first token
    batch, took = _run(sched, 1.0)
    assert took == {"0": EMBEDS - 1 + 20} and batch.encoder_tokens == 0  # from the held features
    batch, took = _run(sched, 2.0)
    assert took == {"0": 1} and batch.num_decodes == 1


def test_a_background_step_that_prefills_encodes_nothing_and_one_that_encodes_prefills_nothing():
    sched = _scheduler()
    for i in range(3):
        sched.add(_request(i, BACKGROUND))
    shapes = []
    for t in range(8):
        batch, took = _run(sched, float(t))
        prefill = batch.num_tokens - batch.num_decodes
        shapes.append((batch.encoder_tokens, prefill, batch.num_decodes))
        if batch.encoder_tokens:  # the image's first token and at most the text before it
            assert prefill <= 4 + 3 * 3
    encodes = [s for s in shapes if s[0]]
    assert len(encodes) == 3 and all(s[0] == EMBEDS for s in encodes)  # one image a step
    assert all(s[1] <= 4 + 3 * 3 for s in encodes)
    assert all(r.num_computed_tokens > r.num_prompt_tokens for r in sched.running)  # all decoding
    assert len(sched.running) == 3


def test_decodes_keep_their_token_in_an_encoding_step():
    sched = _scheduler()
    first = _request(0, BACKGROUND)
    sched.add(first)
    for t in range(3):
        _run(sched, float(t))
    sched.add(_request(1, BACKGROUND))
    batch, took = _run(sched, 5.0)
    assert took == {"0": 1, "1": 4} and batch.encoder_tokens == EMBEDS


def test_foreground_steps_encode_and_prefill_together_as_before():
    sched = _scheduler()
    sched.add(_request(0, 0))
    batch, took = _run(sched, 0.0)
    assert not batch.background_only
    assert took == {"0": 3 + EMBEDS + 20} and batch.encoder_tokens == EMBEDS


def test_whole_images_stay_whole_in_background_steps():
    sched = _scheduler(whole_images=True)  # Gemma 3: an image's keys all written before its queries
    sched.add(_request(0, BACKGROUND))
    batch, took = _run(sched, 0.0)
    assert batch.background_only and took == {"0": 3 + EMBEDS + 20} and batch.encoder_tokens == EMBEDS


def test_background_prefill_is_capped_and_text_requests_are_unchanged():
    sched = _scheduler(prefill_tokens=8)
    sched.add(_request(0, BACKGROUND, words=30, image=False))
    batch, took = _run(sched, 0.0)
    assert batch.background_only and took == {"0": 8}


def test_a_cached_prefix_that_ends_inside_an_image_encodes_it_with_one_token():
    # The prefix cache keeps blocks that end inside an image after the encoder cache dropped its
    # features: the step encodes the image and computes the token after the prefix (it once asked
    # for a negative chunk, admitted the request with none, and ran the state pool out of slots).
    sched = _scheduler()
    first = _request(0, BACKGROUND, words=1)  # 34 prompt tokens, the image at 3..32
    sched.add(first)
    for t in range(3):
        _run(sched, float(t))
        sched.blocks.commit(first)
    sched.finish(first)
    params = SamplingParams(max_tokens=5)
    again = Request(
        "1", list(first.prompt_token_ids), first.images, params, 5.0, 1, frozenset(), priority=BACKGROUND
    )
    sched.add(again)
    batch, took = _run(sched, 5.0)
    assert again.num_cached_tokens == 2 * BS  # two blocks cached: up to the image's last token
    assert batch.background_only and took == {"1": 1} and batch.encoder_tokens == EMBEDS
    batch, took = _run(sched, 6.0)
    assert took == {"1": 1} and batch.encoder_tokens == 0  # the prompt's last token, from held features
    batch, took = _run(sched, 7.0)
    assert took == {"1": 1} and batch.num_decodes == 1
