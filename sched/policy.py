"""Scheduling policies. A policy only ranks requests; the scheduler decides what a rank buys.

A rank is `(tier, score, arrival_time, seq_no)`, lower first. Tier 0 holds requests that have
waited `max_wait_s` or longer: they go ahead of everyone else, which is what bounds starvation.
Tier 2 holds background work (a priority at or above `background_priority`: batch API requests):
it never ages into tier 0 and goes after every other request, so it fills idle capacity and is
preempted first. Within a tier, a lower score goes first. A waiting request may preempt a running
one when it is in a better tier, or in the same tier with a score lower by at least
`preemption_margin`.

Waiting time counts from arrival to first admission and then stops, so a request keeps the place it
earned when it is preempted and comes back.
"""

from __future__ import annotations

from typing import Any, Protocol

Rank = tuple[int, float, float, int]
BACKGROUND = 2  # the tier of background work


class Policy(Protocol):
    name: str
    preemption_margin: float

    def rank(self, req: Any, now: float) -> Rank: ...

    def heap_keys(self, req: Any) -> list[tuple[str, tuple]]:
        """(heap name, key) for each heap a waiting request sorts in, such that for any set of
        waiting requests, at any time, the best-ranked of them is the smallest-key one in one of
        the heaps (sched/waiting_queue.py). A request's rank must not change once it has been
        scheduled: the scheduler ranks running requests once."""
        ...


def is_background(req: Any, background_priority: int | None) -> bool:
    return background_priority is not None and req.priority >= background_priority


def waited(req: Any, now: float) -> float:
    end = req.first_scheduled_time if req.first_scheduled_time is not None else now
    return max(0.0, end - req.arrival_time)


class FCFSPolicy:
    """First come, first served: arrival order, nothing else; never preempts for rank."""

    name = "fcfs"
    preemption_margin = float("inf")

    def __init__(self, background_priority: int | None = None) -> None:
        self.background_priority = background_priority

    def rank(self, req: Any, now: float) -> Rank:
        tier = BACKGROUND if is_background(req, self.background_priority) else 1
        return (tier, 0.0, req.arrival_time, req.seq_no)

    def heap_keys(self, req: Any) -> list[tuple[str, tuple]]:
        name = "background" if is_background(req, self.background_priority) else "arrival"
        return [(name, (req.arrival_time, req.seq_no))]


class PriorityPolicy:
    """Explicit priority (lower first), then image-first, with aging.

    score = priority - image_priority_boost (if the request has images) - aging, where aging grows
    linearly from 0 to `image_priority_boost` over `max_wait_s`: a text request that has waited
    `max_wait_s` has caught up with a fresh image request of its priority, and from then on it is in
    tier 0, ahead of every request that has not waited as long; tier 0 is served oldest first.
    """

    name = "priority"

    def __init__(
        self, image_priority_boost: float = 0.5, max_wait_s: float = 30.0, preemption_margin: float = 1.0,
        background_priority: int | None = None,
    ) -> None:  # fmt: skip
        if image_priority_boost < 0 or max_wait_s <= 0 or preemption_margin <= 0:
            raise ValueError("image_priority_boost must be >= 0, max_wait_s and preemption_margin > 0")
        self.image_priority_boost = image_priority_boost
        self.max_wait_s = max_wait_s
        self.preemption_margin = preemption_margin
        self.background_priority = background_priority

    def rank(self, req: Any, now: float) -> Rank:
        if is_background(req, self.background_priority):  # no aging: it waits for idle capacity
            boost = self.image_priority_boost if req.has_images else 0.0
            return (BACKGROUND, req.priority - boost, req.arrival_time, req.seq_no)
        wait = waited(req, now)
        if wait >= self.max_wait_s:
            # Starved: oldest first, whatever the priority or modality, so the wait stays bounded
            # even when a flood of better-ranked requests is starving too.
            return (0, 0.0, req.arrival_time, req.seq_no)
        boost = self.image_priority_boost if req.has_images else 0.0
        aging = self.image_priority_boost * min(wait / self.max_wait_s, 1.0)
        return (1, req.priority - boost - aging, req.arrival_time, req.seq_no)

    def heap_keys(self, req: Any) -> list[tuple[str, tuple]]:
        if req.first_scheduled_time is not None:  # its wait stopped counting: so did its rank
            return [("frozen", self.rank(req, 0.0))]
        if is_background(req, self.background_priority):  # its rank never changes
            return [("background", self.rank(req, 0.0))]
        # Never scheduled: the starving ones are the oldest (by arrival); the rest are ranked by
        # score = priority - boost - k * (now - arrival), whose order does not depend on `now`.
        boost = self.image_priority_boost if req.has_images else 0.0
        k = self.image_priority_boost / self.max_wait_s
        order = (req.arrival_time, req.seq_no)
        return [("arrival", order), ("score", (req.priority - boost + k * req.arrival_time, *order))]


def outranks(policy: Policy, a: Rank, b: Rank) -> bool:
    """Does rank `a` beat rank `b` by enough to preempt it?"""
    if a[0] != b[0]:
        return a[0] < b[0]
    return b[1] - a[1] >= policy.preemption_margin


def make_policy(
    name: str, image_priority_boost: float = 0.5, max_wait_s: float = 30.0, preemption_margin: float = 1.0,
    background_priority: int | None = None,
) -> Policy:  # fmt: skip
    if name == "fcfs":
        return FCFSPolicy(background_priority)
    if name == "priority":
        return PriorityPolicy(image_priority_boost, max_wait_s, preemption_margin, background_priority)
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {name!r}")
