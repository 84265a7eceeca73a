"""Scheduling policies. A policy only ranks requests; the scheduler decides what a rank buys.

A rank is `(tier, score, arrival_time, seq_no)`, lower first. Tier 0 holds requests that have
waited `max_wait_s` or longer: they go ahead of everyone else, which is what bounds starvation.
Within a tier, a lower score goes first. A waiting request may preempt a running one when it is in
a better tier, or in the same tier with a score lower by at least `preemption_margin`.

Waiting time counts from arrival to first admission and then stops, so a request keeps the place it
earned when it is preempted and comes back.
"""

from __future__ import annotations

from typing import Any, Protocol

Rank = tuple[int, float, float, int]


class Policy(Protocol):
    name: str
    preemption_margin: float

    def rank(self, req: Any, now: float) -> Rank: ...


def waited(req: Any, now: float) -> float:
    end = req.first_scheduled_time if req.first_scheduled_time is not None else now
    return max(0.0, end - req.arrival_time)


class FCFSPolicy:
    """First come, first served: arrival order, nothing else; never preempts for rank."""

    name = "fcfs"
    preemption_margin = float("inf")

    def rank(self, req: Any, now: float) -> Rank:
        return (1, 0.0, req.arrival_time, req.seq_no)


class PriorityPolicy:
    """Explicit priority (lower first), then image-first, with aging.

    score = priority - image_priority_boost (if the request has images) - aging, where aging grows
    linearly from 0 to `image_priority_boost` over `max_wait_s`: a text request that has waited
    `max_wait_s` has caught up with a fresh image request of its priority, and from then on it is in
    tier 0, ahead of every request that has not waited as long; tier 0 is served oldest first.
    """

    name = "priority"

    def __init__(
        self, image_priority_boost: float = 0.5, max_wait_s: float = 30.0, preemption_margin: float = 1.0
    ) -> None:
        if image_priority_boost < 0 or max_wait_s <= 0 or preemption_margin <= 0:
            raise ValueError("image_priority_boost must be >= 0, max_wait_s and preemption_margin > 0")
        self.image_priority_boost = image_priority_boost
        self.max_wait_s = max_wait_s
        self.preemption_margin = preemption_margin

    def rank(self, req: Any, now: float) -> Rank:
        wait = waited(req, now)
        if wait >= self.max_wait_s:
            # Starved: oldest first, whatever the priority or modality, so the wait stays bounded
            # even when a flood of better-ranked requests is starving too.
            return (0, 0.0, req.arrival_time, req.seq_no)
        boost = self.image_priority_boost if req.has_images else 0.0
        aging = self.image_priority_boost * min(wait / self.max_wait_s, 1.0)
        return (1, req.priority - boost - aging, req.arrival_time, req.seq_no)


def outranks(policy: Policy, a: Rank, b: Rank) -> bool:
    """Does rank `a` beat rank `b` by enough to preempt it?"""
    if a[0] != b[0]:
        return a[0] < b[0]
    return b[1] - a[1] >= policy.preemption_margin


def make_policy(
    name: str, image_priority_boost: float = 0.5, max_wait_s: float = 30.0, preemption_margin: float = 1.0
) -> Policy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(image_priority_boost, max_wait_s, preemption_margin)
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {name!r}")
