"""The scheduler's side of `sliced_encoding`: where a step capped for running decodes (or a step of
background work alone) would have encoded a too-big image whole, it gives the image a share of the
step's encoder budget instead, the image's request stops before the image until the features are
in the encoder cache, and the decodes keep their token in every step."""

from __future__ import annotations

import torch

from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.request import ImageSpan, Request
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import PriorityPolicy
from mm_engine.sched.scheduler import Scheduler
from mm_engine.vision.encoder_cache import EncoderCache

BS, IMG_ID, EMBEDS, BACKGROUND = 16, 99, 40, 10


def _scheduler(sliced: bool = True, cap: int | None = 8, boost: float = 0.5) -> Scheduler:
    blocks = BlockManager(BlockPool(TEXT, 0, 400), BlockPool(IMAGE, 400, 100), BS, True, 0.0)
    policy = PriorityPolicy(
        image_priority_boost=boost, max_wait_s=1000.0, preemption_margin=1.0, background_priority=BACKGROUND
    )
    return Scheduler(
        blocks, policy, 64, 4096, EncoderCache(10**9), 4096, decode_step_prefill_tokens=cap,
        background_prefill_tokens=16, sliced_encoding=sliced,
    )  # fmt: skip


def _request(rid: int, image: str | None = None, priority: int = 0, max_tokens: int = 50) -> Request:
    spans = [ImageSpan(3, EMBEDS, torch.zeros(1), image)] if image else []
    ids = [1, 2, 3] + [IMG_ID] * (EMBEDS if image else 0) + [5] * 4
    params = SamplingParams(max_tokens=max_tokens)
    return Request(str(rid), ids, spans, params, float(rid), rid, frozenset(), priority=priority)


def _run(sched: Scheduler, now: float, encoded: dict[str, int]):
    """A step settled as the core and runner would: shares add up to the image, then it is cached."""
    batch = sched.schedule(now)
    for req, j, tokens in batch.encode_slices:
        key = req.images[j].content_hash
        encoded[key] = encoded.get(key, 0) + tokens
        if encoded[key] >= req.images[j].num_embeds:
            sched.encoder_cache.put(key, torch.zeros(req.images[j].num_embeds))
    for req, n in batch.items:
        req.num_computed_tokens += n
        if req.num_computed_tokens >= req.num_prompt_tokens:
            req.token_ids.append(7)
    return batch, {req.request_id: n for req, n in batch.items}


def _decoding(sched: Scheduler, encoded: dict[str, int]) -> Request:
    stream = _request(0)
    sched.add(stream)
    _run(sched, 0.0, encoded)  # its prompt
    return stream


def test_an_image_too_big_for_the_cap_is_encoded_in_shares_beside_the_decodes():
    sched, encoded = _scheduler(), {}
    _decoding(sched, encoded)
    sched.add(_request(1, "big"))
    steps = []
    for t in range(1, 12):
        batch, took = _run(sched, float(t), encoded)
        steps.append((took, [(r.request_id, k) for r, _, k in batch.encode_slices], batch.encoder_tokens))
        assert took["0"] == 1  # the stream's token, every step
    shares = [s for s in steps if s[1]]
    assert [s[1] for s in shares] == [[("1", 8)]] * (EMBEDS // 8)  # the cap's worth a step
    assert all(s[2] == 8 and s[0].get("1", 0) <= 3 for s in shares)  # only the text before it
    after = steps[len(shares)]
    assert after[0]["1"] == 8 and after[1] == [] and after[2] == 0  # then prefilled, from the cache


def test_without_slicing_the_image_goes_whole_beside_the_decodes():
    sched, encoded = _scheduler(sliced=False), {}
    _decoding(sched, encoded)
    sched.add(_request(1, "big"))
    batch, took = _run(sched, 1.0, encoded)
    assert batch.encode_slices == [] and batch.encoder_tokens == EMBEDS and took["1"] == 8


def test_an_image_that_fits_is_not_sliced_and_an_idle_step_encodes_it_whole():
    sched, encoded = _scheduler(cap=64), {}
    _decoding(sched, encoded)
    sched.add(_request(1, "fits"))
    batch, _ = _run(sched, 1.0, encoded)
    assert batch.encode_slices == [] and batch.encoder_tokens == EMBEDS
    idle, encoded = _scheduler(), {}  # no decodes running: no cap, one step takes it whole
    idle.add(_request(1, "alone"))
    batch, _ = _run(idle, 0.0, encoded)
    assert batch.encode_slices == [] and batch.encoder_tokens == EMBEDS


def test_two_requests_with_one_image_get_one_share_a_step():
    sched, encoded = _scheduler(), {}
    _decoding(sched, encoded)
    sched.add(_request(1, "same"))
    sched.add(_request(2, "same"))
    batch, _ = _run(sched, 1.0, encoded)
    assert [(r.request_id, k) for r, _, k in batch.encode_slices] == [("1", 8)]


def test_a_background_image_is_encoded_in_shares_of_the_background_prefill():
    sched, encoded = _scheduler(cap=None), {}
    sched.add(_request(1, "batch", priority=BACKGROUND))
    shares = []
    for t in range(6):
        batch, took = _run(sched, float(t), encoded)
        assert batch.background_only
        shares += [k for _, _, k in batch.encode_slices]
        if batch.encode_slices:
            assert took.get("1", 0) == 0  # the share is the step's prompt work
    assert shares == [16, 16, 16]  # background_prefill_tokens a step, until the 40 are done


def test_a_background_step_that_prefills_gives_no_share():
    sched, encoded = _scheduler(cap=None, boost=0.0), {}  # no image-first: arrival order
    sched.add(_request(1, priority=BACKGROUND))  # text only: its prefill is the step's prompt work
    sched.add(_request(2, "batch", priority=BACKGROUND))
    batch, took = _run(sched, 0.0, encoded)
    assert took == {"1": 7, "2": 3} and batch.encode_slices == []  # the text before the image only
    batch, took = _run(sched, 1.0, encoded)
    assert [k for _, _, k in batch.encode_slices] == [16]  # the next step: its first share
