"""Whom to preempt: the fewest lowest-ranked running requests whose blocks free what is short.

A request that needs blocks from one pool gains nothing from preempting a request that holds none
there (under image-first, the lowest-ranked running request is often a text request, which frees
no image block), and a block that another request also holds (a shared prefix) is freed only when
all its holders go. So candidates holding blocks of a short pool are taken lowest rank first until
what they free together covers the shortfall; then any whose preemption turns out not to be needed
is put back. The choice is all or nothing: when even every candidate together cannot cover the
shortfall, nobody is preempted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from mm_engine.pools.block_manager import BlockManager
from mm_engine.request import Request


def choose_victims(
    blocks: BlockManager, short: dict[str, int], seats_short: int, candidates: Iterable[Request]
) -> list[Request] | None:
    """Victims (lowest rank first, as `candidates` come) whose preemption covers `short` blocks per
    pool and `seats_short` running seats; None when the candidates cannot cover it."""
    short = {pool: n for pool, n in short.items() if n > 0}
    chosen: list[Request] = []
    remaining = iter(candidates)
    while not _covers(blocks, chosen, short, seats_short):
        cand = next(remaining, None)
        if cand is None:
            return None
        if seats_short > len(chosen) or any(blocks.pool_of(b).name in short for b in cand.block_table):
            chosen.append(cand)
    for victim in list(chosen):  # a victim the others cover without stays
        rest = [v for v in chosen if v is not victim]
        if _covers(blocks, rest, short, seats_short):
            chosen = rest
    return chosen


def _covers(blocks: BlockManager, victims: list[Request], short: dict[str, int], seats: int) -> bool:
    if len(victims) < seats:
        return False
    released = Counter(b for v in victims for b in v.block_table)
    freed: Counter[str] = Counter()
    for block, refs in released.items():
        pool = blocks.pool_of(block)
        if refs >= pool.ref_count(block):
            freed[pool.name] += 1
    return all(freed[pool] >= n for pool, n in short.items())
