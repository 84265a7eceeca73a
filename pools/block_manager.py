"""Gives each sequence the blocks it needs, from the image pool or the text pool.

Block `i` of a sequence holds token positions `[i * block_size, (i + 1) * block_size)`. It comes
from the image pool when every one of those positions is an image token of the prompt, and from the
text pool otherwise (text, generated tokens, or a mix). The decision depends only on the prompt, so
it is computed once per request.
"""

from __future__ import annotations

from typing import Any

from mm_engine.pools.block_pool import BlockPool

TEXT, IMAGE = "text", "image"


class BlockManager:
    def __init__(self, text_pool: BlockPool, image_pool: BlockPool, block_size: int) -> None:
        self.pools = {TEXT: text_pool, IMAGE: image_pool}
        self.block_size = block_size
        self._flags_cache: dict[str, list[bool]] = {}  # request id -> image_block_flags

    def image_block_flags(self, req: Any) -> list[bool]:
        """For each full block inside the prompt: is it made only of image tokens?"""
        bs = self.block_size
        if self.pools[IMAGE].num_blocks == 0:  # no image pool: every block is a text block
            return [False] * (req.num_prompt_tokens // bs)
        is_image = [False] * req.num_prompt_tokens
        for span in req.images:
            is_image[span.offset : span.offset + span.length] = [True] * span.length
        return [all(is_image[i * bs : (i + 1) * bs]) for i in range(req.num_prompt_tokens // bs)]

    def blocks_needed(self, req: Any, num_tokens: int) -> dict[str, int]:
        """Blocks of each pool that `num_tokens` tokens of this request occupy in total."""
        n_blocks = -(-num_tokens // self.block_size)
        image = sum(self.image_block_flags(req)[:n_blocks])
        return {TEXT: n_blocks - image, IMAGE: image}

    def allocate(self, req: Any, num_new_tokens: int) -> bool:
        """Extend the block table to hold `num_new_tokens` more tokens; all or nothing."""
        have = len(req.block_table)
        want = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        if want <= have:
            return True
        flags = self._flags_for(req)
        kinds = [IMAGE if i < len(flags) and flags[i] else TEXT for i in range(have, want)]
        need = {TEXT: kinds.count(TEXT), IMAGE: kinds.count(IMAGE)}
        if any(need[k] > self.pools[k].num_free for k in need):
            return False
        fresh = {k: iter(self.pools[k].allocate(n)) for k, n in need.items()}
        req.block_table.extend(next(fresh[k]) for k in kinds)
        return True

    def _flags_for(self, req: Any) -> list[bool]:
        cached = self._flags_cache.get(req.request_id)
        if cached is None:
            cached = self._flags_cache[req.request_id] = self.image_block_flags(req)
        return cached

    def free(self, req: Any) -> None:
        for block in req.block_table:
            self.pool_of(block).release(block)
        req.block_table = []

    def forget(self, req: Any) -> None:
        """Drop per-request bookkeeping once the request has finished for good."""
        self._flags_cache.pop(req.request_id, None)

    def pool_of(self, block: int) -> BlockPool:
        return self.pools[IMAGE] if block in self.pools[IMAGE] else self.pools[TEXT]

    def report(self, requests: list[Any]) -> dict[str, dict[str, int]]:
        filled = {TEXT: 0, IMAGE: 0}
        for req in requests:
            for i, block in enumerate(req.block_table):
                n = min(self.block_size, max(0, req.num_computed_tokens - i * self.block_size))
                filled[IMAGE if block in self.pools[IMAGE] else TEXT] += n
        return {
            name: {
                "total_blocks": pool.num_blocks,
                "used_blocks": pool.num_used,
                "free_blocks": pool.num_free,
                "allocated_slots": pool.num_used * self.block_size,
                "filled_slots": filled[name],
            }
            for name, pool in self.pools.items()
        }
