"""Scheduling policies. A policy only ranks requests; the scheduler decides what that buys.

A lower rank is served first. The scheduler keeps both queues sorted by rank, admits waiting
requests in that order and, when memory runs out, preempts the running request ranked last.
"""

from __future__ import annotations

from typing import Any, Protocol


class Policy(Protocol):
    name: str

    def rank(self, req: Any, now: float) -> tuple: ...


class FCFSPolicy:
    """First come, first served: arrival order, nothing else."""

    name = "fcfs"

    def rank(self, req: Any, now: float) -> tuple:
        return (req.arrival_time, req.seq_no)


def make_policy(name: str) -> Policy:
    policies = {"fcfs": FCFSPolicy}
    if name not in policies:
        raise ValueError(f"scheduling_policy must be one of {sorted(policies)}, got {name!r}")
    return policies[name]()
