"""Preemption frees blocks of the pool that is short: a request that needs an image block does not
preempt a text request (which holds none), a shared block is not counted as freed by preempting
one of its holders, and when nothing can free enough, nobody is preempted."""

from __future__ import annotations

import torch

from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.request import ImageSpan, Request, Status
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import PriorityPolicy
from mm_engine.sched.scheduler import Scheduler
from mm_engine.sched.victims import choose_victims
from mm_engine.vision.encoder_cache import EncoderCache

BS, IMG = 4, 99


def _scheduler(n_text: int = 20, n_image: int = 2) -> Scheduler:
    blocks = BlockManager(BlockPool(TEXT, 0, n_text), BlockPool(IMAGE, n_text, n_image), BS, True, 0.0)
    policy = PriorityPolicy(image_priority_boost=0.5, max_wait_s=1000.0, preemption_margin=1.0)
    return Scheduler(blocks, policy, 4, 64, EncoderCache(10**6), 64)


def _request(rid: str, image: str | None, priority: int = 0, words: int = 2, image_tokens: int = 8):
    # An image first: 8 tokens fill 2 image blocks exactly.
    spans = [ImageSpan(0, image_tokens, torch.zeros(1), image)] if image else []
    ids = [IMG] * image_tokens * bool(image) + list(range(1, words + 1))
    seq = int(rid[1:])
    params = SamplingParams(max_tokens=4)
    return Request(rid, ids, spans, params, float(seq), seq, frozenset(), priority=priority)


def _run_prompt(sched: Scheduler, now: float) -> None:
    for req, n in sched.schedule(now).items:
        req.num_computed_tokens += n
        sched.blocks.commit(req)


def test_an_image_request_preempts_the_image_request_not_the_text_one():
    sched = _scheduler()
    text, image = _request("r0", None, words=6), _request("r1", "a")
    sched.add(text)
    sched.add(image)
    _run_prompt(sched, 2.0)
    assert text.status is image.status is Status.RUNNING
    assert sched.blocks.pools[IMAGE].num_available == 0  # the image request holds both
    urgent = _request("r2", "b", priority=-5)  # outranks both by the margin; needs 2 image blocks
    sched.add(urgent)
    batch = sched.schedule(3.0)
    assert batch.preempted == [image]  # before: the text request first, which freed nothing
    assert text.status is Status.RUNNING and urgent.status is Status.RUNNING
    assert sched.num_preemptions == 1


def test_nobody_is_preempted_when_the_candidates_cannot_free_enough():
    sched = _scheduler(n_image=3)
    text, image = _request("r0", None, words=6), _request("r1", "a")
    for r in (text, image):
        sched.add(r)
    _run_prompt(sched, 2.0)
    big = _request("r2", "b", priority=-5, image_tokens=16)  # 4 image blocks; the pool has 3
    sched.add(big)
    batch = sched.schedule(3.0)
    # Preempting both would still leave it one image block short: nothing is undone for nothing.
    assert batch.preempted == [] and big.status is Status.WAITING
    assert text.status is image.status is Status.RUNNING


def test_a_shared_block_is_not_counted_as_freed_by_one_holder():
    sched = _scheduler()
    first, second = _request("r0", "a"), _request("r1", "a")  # same image: shared image blocks
    sched.add(first)
    _run_prompt(sched, 1.0)
    sched.add(second)
    _run_prompt(sched, 2.0)
    assert first.block_table[:2] == second.block_table[:2]
    short = {IMAGE: 1, TEXT: 0}
    # Either holder alone frees no image block; both together free both.
    assert choose_victims(sched.blocks, short, 0, [second]) is None
    assert choose_victims(sched.blocks, short, 0, [second, first]) == [second, first]
    # A seat is freed by anyone; nothing short needs nobody.
    assert choose_victims(sched.blocks, {IMAGE: 0, TEXT: 0}, 1, [second]) == [second]
    assert choose_victims(sched.blocks, {IMAGE: 0}, 0, [second]) == []
