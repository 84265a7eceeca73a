"""The waiting queue gives requests in exactly the order a full sort by the policy's rank would,
at any time, through adds, removals, re-adds (preemption) and partial iterations; so the
scheduler admits in the same order as when it re-ranked and re-sorted everything each step."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mm_engine.request import ImageSpan, Request
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import FCFSPolicy, PriorityPolicy
from mm_engine.sched.waiting_queue import WaitingQueue

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.booleans(), st.floats(0, 40)),
        st.tuples(st.just("remove"), st.integers(0, 10_000)),
        st.tuples(st.just("readd"), st.integers(0, 10_000), st.floats(0, 40)),  # a preemption
        st.tuples(st.just("look"), st.floats(0, 200), st.integers(0, 6)),  # a step looks at a few
    ),
    max_size=60,
)


def _request(seq: int, priority: int, image: bool, arrival: float) -> Request:
    spans = [ImageSpan(1, 4, torch.zeros(1), f"i{seq}")] if image else []
    return Request(str(seq), [1] * 6, spans, SamplingParams(), arrival, seq, frozenset(), priority=priority)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, priority_policy=st.booleans(), background=st.sampled_from([None, 2]))
def test_rank_order_equals_a_full_sort(ops, priority_policy, background):
    """Priorities 0-3; with `background=2`, priorities 2 and 3 are background work (a tier of their own)."""
    policy = PriorityPolicy(0.5, 30.0, 1.0, background) if priority_policy else FCFSPolicy(background)
    queue, live, seq, now = WaitingQueue(policy), {}, itertools.count(), 0.0
    for op in ops:
        if op[0] == "add":
            now += op[3] / 10
            req = _request(next(seq), op[1], op[2], now)
            live[req.request_id] = req
            queue.add(req)
        elif op[0] in ("remove", "readd") and live:
            req = live[sorted(live)[op[1] % len(live)]]
            queue.remove(req)
            if op[0] == "readd":  # it ran for a while and was preempted: its wait is frozen
                req.first_scheduled_time = req.arrival_time + op[2]
                queue.add(req)
            else:
                del live[req.request_id]
        elif op[0] == "look":
            now += op[1] / 10
            it = queue.in_rank_order(now)
            looked = list(itertools.islice(it, op[2]))
            it.close()
            want = sorted(live.values(), key=lambda r: policy.rank(r, now))
            assert looked == want[: op[2]]
        assert len(queue) == len(live) and set(queue) == set(live.values())
    full = list(queue.in_rank_order(now))
    assert full == sorted(live.values(), key=lambda r: policy.rank(r, now))
