"""The block manager of a hybrid model (Qwen3.5): prefix reuse that also restores the linear
layers' state.

A cached prefix is taken only up to its deepest point that has a state snapshot
(state_snapshots.py): the full blocks (and a copied prompt tail) past it are given back, and the
request's first forward starts by copying that snapshot into its state slot (`restore_row`).
While a prompt is computed, `plan_snapshots` picks the points in a chunk whose state is kept: the
last block boundary at or before each image's end (another question about the same image
continues there), the last block boundary before the prompt's last token (the same prompt again,
or the next turn of a conversation), the point just before that token (the `n` samples of one
prompt, which share its partial last block by copy), and the chunk's end where it is a block
boundary (the block-aligned points of a long prompt, where a request that arrives meanwhile
with the same prefix can pick up). A snapshot goes when its block is
evicted or its tail's owner ends.
"""

from __future__ import annotations

from typing import Any

from mm_engine.pools.block_manager import BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.pools.state_snapshots import StateSnapshots


class HybridBlockManager(BlockManager):
    def __init__(
        self, text_pool: BlockPool, image_pool: BlockPool, block_size: int, snapshots: StateSnapshots,
        watermark: float = 0.01,
    ) -> None:  # fmt: skip
        super().__init__(text_pool, image_pool, block_size, True, watermark)
        self.snapshots = snapshots
        self._restore: dict[str, int | None] = {}  # request id -> the row its match ends at
        for pool in self.pools.values():
            pool.on_forget = snapshots.drop

    def state_key(self, req: Any, point: int) -> bytes | None:
        """The key of the state after the first `point` tokens: the hash of the block ending
        there, or of the prompt's tail (the one unaligned point snapshots are taken at)."""
        bs = self.block_size
        if point % bs == 0:
            self._hash_full_blocks(req, upto=point // bs)
            return req.block_hashes[point // bs - 1]
        return self._tail_hash(req) if point == req.num_prompt_tokens - 1 else None

    def match_prefix(self, req: Any, count: bool = True) -> int:
        n = super().match_prefix(req, count)
        bs, rid = self.block_size, req.request_id
        if n % bs and not self.snapshots.has(self.state_key(req, n)):  # a copied tail without its state
            src, dst = self._copies.pop(rid)
            self.pool_of(src).release(src)
            self.partial_block_copies[self.pool_of(dst).name] -= 1
            self.pool_of(req.block_table.pop()).release(dst)
            n = len(req.block_table) * bs
        while n and n % bs == 0 and not self.snapshots.has(self.state_key(req, n)):
            self.pool_of(req.block_table[-1]).release(req.block_table.pop())
            n -= bs
        req.num_computed_tokens = n
        req.num_registered_blocks = min(req.num_registered_blocks, len(req.block_table))
        # Its row, taken now: admitting it may preempt the snapshot's owner (a tail goes with it);
        # a row dropped meanwhile is still read before anything writes it (copies run first).
        self._restore[rid] = self.snapshots.peek(self.state_key(req, n)) if n else None
        return n

    def restore_row(self, req: Any) -> int | None:
        """The snapshot row a just-admitted request starts from (None: it starts from zeros)."""
        row = self._restore.pop(req.request_id, None)
        if row is not None:
            self.snapshots.restored += 1
        return row

    def plan_snapshots(self, req: Any, start: int, end: int) -> list[tuple[int, int]]:
        """(tokens into the chunk `[start, end)`, row) for each point in it whose state to keep."""
        last = req.num_prompt_tokens - 1
        if start >= last:
            return []
        bs = self.block_size
        points = {(span.offset + span.length) // bs * bs for span in req.images} | {last // bs * bs, last}
        if end % bs == 0:  # a chunk that ends on a block boundary: its state is there anyway
            points.add(end)
        out = []
        for p in sorted(p for p in points if start < p <= min(end, last)):
            row = self.snapshots.reserve(req.request_id, self.state_key(req, p))
            if row is not None:
                out.append((p - start, row))
        return out

    def _alive(self, key: bytes) -> bool:
        return key in self._tails or any(pool.caches(key) for pool in self.pools.values())

    def commit(self, req: Any) -> bool:
        registered = super().commit(req)
        return self.snapshots.publish(req.request_id, self._alive) or registered

    def uncommit(self, req: Any, before: int) -> None:
        super().uncommit(req, before)
        self.snapshots.unpublish(req.request_id)

    def free(self, req: Any) -> None:
        tail = self._tail_of.get(req.request_id)
        super().free(req)
        if tail is not None:
            self.snapshots.drop(tail)
        self.snapshots.discard(req.request_id)
        self._restore.pop(req.request_id, None)
