"""One pool of KV blocks: a contiguous range of block ids in the shared K/V tensors.

The pool owns which of its blocks are free and how many holders each used block has. It knows
nothing about sequences or tokens; the block manager decides which pool a block comes from.
"""

from __future__ import annotations

from collections import deque


class PoolExhausted(RuntimeError):
    """Raised when a pool is asked for more blocks than it has free."""


class BlockPool:
    def __init__(self, name: str, first_block: int, num_blocks: int) -> None:
        self.name = name
        self.first_block = first_block
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(first_block, first_block + num_blocks))
        self._refs: list[int] = [0] * num_blocks

    def __contains__(self, block: int) -> bool:
        return self.first_block <= block < self.first_block + self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._refs[block - self.first_block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.name} pool: asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b - self.first_block] = 1
        return blocks

    def release(self, block: int) -> None:
        i = block - self.first_block
        if not 0 <= i < self.num_blocks or self._refs[i] <= 0:
            raise RuntimeError(f"{self.name} pool: block {block} released but not held")
        self._refs[i] -= 1
        if self._refs[i] == 0:
            self._free.append(block)
