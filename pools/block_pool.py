"""One pool of KV blocks: a contiguous range of block ids in the shared K/V tensors.

A block is in exactly one of three states:
- free: holds nothing worth keeping (in `_free`);
- used: held by one or more sequences (`ref_count > 0`);
- cached: held by nobody but still holding the KV of a known content hash, so a later request with
  the same prefix can take it instead of recomputing (in `_evictable`, least recently used first).
Allocation takes free blocks first and then evicts cached ones, oldest first, within this pool only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class PoolExhausted(RuntimeError):
    """Raised when a pool is asked for more blocks than it can give."""


class BlockPool:
    def __init__(self, name: str, first_block: int, num_blocks: int) -> None:
        self.name = name
        self.first_block = first_block
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(first_block, first_block + num_blocks))
        self._refs: list[int] = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> content hash, for blocks holding cached KV
        self._by_hash: dict[int, int] = {}  # content hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.hits = 0
        self.queries = 0
        self.evictions = 0
        # Told each content hash this pool stops caching (what hangs off a block goes with it).
        self.on_forget: Callable[[int], None] | None = None

    def __contains__(self, block: int) -> bool:
        return self.first_block <= block < self.first_block + self.num_blocks

    @property
    def num_available(self) -> int:
        """Blocks that an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block: int) -> int:
        return self._refs[block - self.first_block]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise PoolExhausted(f"{self.name} pool: asked for {n} blocks, {self.num_available} available")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                gone = self._hash_of.pop(block)
                del self._by_hash[gone]
                self.evictions += 1
                if self.on_forget is not None:
                    self.on_forget(gone)
            self._refs[block - self.first_block] = 1
            blocks.append(block)
        return blocks

    def hold(self, block: int) -> None:
        """One more reference on a block someone already holds (a copy source, kept until read)."""
        i = block - self.first_block
        if not 0 <= i < self.num_blocks or self._refs[i] <= 0:
            raise RuntimeError(f"{self.name} pool: block {block} held again but not held")
        self._refs[i] += 1

    def release(self, block: int) -> None:
        i = block - self.first_block
        if not 0 <= i < self.num_blocks or self._refs[i] <= 0:
            raise RuntimeError(f"{self.name} pool: block {block} released but not held")
        self._refs[i] -= 1
        if self._refs[i] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # most recently used goes last
            else:
                self._free.append(block)

    # ---- content-hash reuse ------------------------------------------------------------------

    def lookup(self, content_hash: int, count: bool = True) -> int | None:
        """Take a reference on the block caching this hash, if any (`count`: into the queries and
        hits)."""
        self.queries += count
        block = self._by_hash.get(content_hash)
        if block is None:
            return None
        self.hits += count
        i = block - self.first_block
        if self._refs[i] == 0:
            del self._evictable[block]
        self._refs[i] += 1
        return block

    def register(self, block: int, content_hash: int) -> None:
        """Record that a held block now holds the full KV of `content_hash`."""
        if block in self._hash_of or content_hash in self._by_hash:
            return  # already known, or another block caches the same content: keep the first
        self._hash_of[block] = content_hash
        self._by_hash[content_hash] = block

    def forget(self, block: int) -> None:
        """Drop a held block's hash (its KV is about to change or be discarded)."""
        content_hash = self._hash_of.pop(block, None)
        if content_hash is not None:
            del self._by_hash[content_hash]
            if self.on_forget is not None:
                self.on_forget(content_hash)

    def caches(self, content_hash: int) -> bool:
        return content_hash in self._by_hash

    def blocks_by_state(self) -> tuple[set[int], set[int], set[int]]:
        """(free, used, cached) block sets, for invariant checks."""
        free = set(self._free)
        cached = set(self._evictable)
        used = {self.first_block + i for i, r in enumerate(self._refs) if r > 0}
        return free, used, cached
