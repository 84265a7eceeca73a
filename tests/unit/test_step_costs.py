"""The step-time bound: the cost model recovers how long steps take from the steps that ran, and a
step with running decodes adds only the prefill and encoding that keep it within the factor."""

from __future__ import annotations

import random

import pytest
import torch

from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.request import ImageSpan, Request
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import PriorityPolicy
from mm_engine.sched.scheduler import Scheduler
from mm_engine.sched.step_costs import Costs, StepCosts, StepShape
from mm_engine.vision.encoder_cache import EncoderCache

TRUE = Costs(fixed=0.010, per_decode=0.002, per_prefill=0.0005, per_encoded=0.001)
BS, IMG_ID = 16, 99


def _varied_steps(n: int, seed: int = 0, encode: bool = True):
    rng = random.Random(seed)
    for _ in range(n):
        yield StepShape(
            rng.randint(0, 64), rng.choice([0, 0, rng.randint(1, 768)]), encode * rng.choice([0, 196])
        )


def test_the_fit_recovers_the_costs_of_varied_steps():
    costs = StepCosts()
    for shape in _varied_steps(64):
        costs.observe(shape, TRUE.seconds(shape))
    fit = costs.fitted()
    for name in ("fixed", "per_decode", "per_prefill", "per_encoded"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-4), name


def test_no_fit_before_enough_steps_and_encoding_unseen_costs_what_prefill_does():
    costs = StepCosts(min_steps=8)
    for _ in range(7):
        costs.observe(StepShape(4, 100, 0), 0.1)
    assert costs.fitted() is None  # seven steps
    for shape in _varied_steps(32, encode=False):
        costs.observe(shape, TRUE.seconds(shape))
    fit = costs.fitted()
    assert fit.per_encoded == fit.per_prefill > 0


def test_a_cost_the_data_would_make_negative_is_zero_and_the_rest_still_fit():
    costs = StepCosts()
    rng = random.Random(1)
    for _ in range(40):  # decodes make a step no slower: their best fit alone would be below zero
        shape = StepShape(rng.randint(0, 64), rng.randint(1, 500), 0)
        costs.observe(shape, 0.01 + 0.001 * shape.prefill_tokens - 1e-5 * shape.decodes)
    fit = costs.fitted()
    assert fit.per_decode == 0.0 and fit.per_prefill > 0 and fit.fixed > 0


def test_recent_steps_outweigh_old_ones():
    costs = StepCosts(decay=0.9)
    slow = Costs(0.02, 0.004, 0.001, 0.002)
    for shape in _varied_steps(50):
        costs.observe(shape, slow.seconds(shape))
    for shape in _varied_steps(100, seed=1):
        costs.observe(shape, TRUE.seconds(shape))
    assert costs.fitted().per_prefill == pytest.approx(TRUE.per_prefill, rel=0.01)


def _scheduler(factor: float | None, cap: int | None = None) -> Scheduler:
    blocks = BlockManager(BlockPool(TEXT, 0, 400), BlockPool(IMAGE, 400, 100), BS, True, 0.0)
    policy = PriorityPolicy(image_priority_boost=0.5, max_wait_s=1000.0, preemption_margin=1.0)
    sched = Scheduler(
        blocks, policy, 64, 4096, EncoderCache(10**9), 4096, decode_step_prefill_tokens=cap,
        step_time_factor=factor,
    )  # fmt: skip
    for shape in _varied_steps(64):
        sched.costs.observe(shape, TRUE.seconds(shape))
    return sched


def _request(rid: int, words: int, image_tokens: int = 0) -> Request:
    spans = [ImageSpan(1, image_tokens, torch.zeros(1), f"img{rid}")] if image_tokens else []
    ids = [1] + [IMG_ID] * image_tokens + [5] * words
    return Request(str(rid), ids, spans, SamplingParams(max_tokens=50), float(rid), rid, frozenset())


def _start_decoding(sched: Scheduler, n: int) -> None:
    for i in range(n):
        sched.add(_request(i, 3))
    for req, k in sched.schedule(0.0).items:
        req.num_computed_tokens += k
        req.token_ids.append(7)


def test_beside_decodes_a_step_adds_the_prefill_that_fits_the_factor():
    sched = _scheduler(factor=2.0)
    _start_decoding(sched, 10)
    sched.add(_request(100, 1000))
    batch = sched.schedule(1.0)
    alone = TRUE.fixed + 10 * TRUE.per_decode  # 0.030 s
    prefill = batch.num_tokens - batch.num_decodes
    assert batch.num_decodes == 10
    assert prefill == pytest.approx(alone / TRUE.per_prefill, abs=1)  # 60 tokens: the step takes 2x
    sched.observe_step(batch, 0.06)  # what the batch reports feeds the model back
    assert sched.costs._steps == 65


def test_an_image_spends_the_same_time_and_one_image_always_goes():
    sched = _scheduler(factor=3.0)
    _start_decoding(sched, 10)
    sched.add(_request(100, 20, image_tokens=30))  # 0.030 s of encoding fits 0.060 s of extra time
    batch = sched.schedule(1.0)
    assert batch.encoder_tokens == 30
    prefill = batch.num_tokens - batch.num_decodes
    assert prefill <= 0.060 / TRUE.per_prefill - 30 * TRUE.per_encoded / TRUE.per_prefill + 1
    sched = _scheduler(factor=1.1)
    _start_decoding(sched, 10)
    sched.add(_request(100, 20, image_tokens=300))  # far over the time: still encoded, alone
    batch = sched.schedule(1.0)
    assert batch.encoder_tokens == 300


def test_the_token_cap_and_the_factor_together_take_the_smaller():
    sched = _scheduler(factor=2.0, cap=32)
    _start_decoding(sched, 10)
    sched.add(_request(100, 1000))
    batch = sched.schedule(1.0)
    assert batch.num_tokens - batch.num_decodes == 32
    sched = _scheduler(factor=None)  # no time bound, no cap: the whole budget
    _start_decoding(sched, 10)
    sched.add(_request(100, 1000))
    assert sched.schedule(1.0).num_tokens == 10 + 1001
