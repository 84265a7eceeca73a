"""The hybrid block manager's prefix reuse (pools/hybrid_blocks.py) step by step: a match is cut
back to its deepest state snapshot, and the row a match ends at is kept for its admission even if
the snapshot's owner is freed in between (as when admitting it preempts that owner)."""

from __future__ import annotations

from mm_engine.pools.block_manager import IMAGE, TEXT
from mm_engine.pools.block_pool import BlockPool
from mm_engine.pools.hybrid_blocks import HybridBlockManager
from mm_engine.pools.state_snapshots import StateSnapshots
from mm_engine.request import Request
from mm_engine.sampling_params import SamplingParams

BS = 4


def manager(rows: int = 4) -> HybridBlockManager:
    return HybridBlockManager(
        BlockPool(TEXT, 0, 16), BlockPool(IMAGE, 16, 4), BS, StateSnapshots(range(8, 8 + rows))
    )


def request(rid: str, ids: list[int]) -> Request:
    return Request(rid, list(ids), [], SamplingParams(max_tokens=4), 0.0, 0, frozenset())


def compute_prompt(blocks: HybridBlockManager, req: Request) -> dict[int, int]:
    """Run a request's whole prompt as one chunk; the snapshot points planned: point -> row."""
    n = req.num_prompt_tokens
    assert blocks.allocate(req, n)
    planned = {off: row for off, row in blocks.plan_snapshots(req, 0, n)}
    req.num_computed_tokens = n
    blocks.commit(req)
    return planned


def test_a_match_ends_at_the_deepest_snapshot_and_keeps_its_row():
    blocks = manager()
    prompt = list(range(1, 11))  # 10 tokens: blocks [0, 4) [4, 8), then a tail up to token 9
    owner = request("a", prompt)
    planned = compute_prompt(blocks, owner)
    assert sorted(planned) == [8, 9]  # the last block boundary before the last token, and just before it
    sibling = request("b", prompt)
    assert blocks.match_prefix(sibling) == 9  # both full blocks and a copy of the partial one
    blocks.free(owner)  # (admitting the sibling preempted the owner: its tail and tail snapshot go)
    assert not blocks.snapshots.has(blocks.state_key(sibling, 9))
    assert blocks.restore_row(sibling) == planned[9]  # still read before anything writes it
    assert blocks.restore_row(sibling) is None  # taken once


def test_without_a_snapshot_the_match_stops_at_the_last_one_there_is():
    blocks = manager()
    prompt = list(range(1, 11))
    owner = request("a", prompt)
    compute_prompt(blocks, owner)
    blocks.snapshots.drop(blocks.state_key(owner, 9))  # the tail's state is gone: full blocks only
    other = request("b", prompt)
    assert blocks.match_prefix(other) == 8 and len(other.block_table) == 2
    blocks.snapshots.drop(blocks.state_key(owner, 8))
    third = request("c", prompt)
    assert blocks.match_prefix(third) == 0 and third.block_table == []  # a KV prefix alone is no use
    for req in (owner, other, third):
        blocks.free(req)
    assert all(pool.num_used == 0 for pool in blocks.pools.values())
