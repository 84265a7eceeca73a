"""Gives each sequence the blocks it needs, from the image pool or the text pool, and reuses cached
blocks of identical prefixes.

Block `i` of a sequence holds token positions `[i * block_size, (i + 1) * block_size)`. It comes
from the image pool when every one of those positions carries a vision embedding (row, column and
break tokens around an image's tiles do not), and from the text pool otherwise (text, generated
tokens, or a mix).

Every full block gets a content hash: SHA-256 over the parent block's hash, its token ids and, for
the image tokens in it, the image's content hash and the offset into the image. Two different
images therefore never share KV although their placeholder tokens are equal, and a cryptographic
hash means no one can craft a collision to read another request's KV.

A prompt's last, partial block is shared by copy: once a request has computed its prompt, its
partial block is registered under a hash of the prompt tokens in it (up to the last one, whose
logits every request computes itself). A later request with the same prompt (the `n` samples of
one, or the same question again) takes the full blocks by reference and gets a fresh block with
a copy of that partial one, since it writes its own tokens there next: copy on write. The copy
runs on the device at the start of the step that admits it (`take_copies`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from mm_engine.pools.block_pool import BlockPool

TEXT, IMAGE = "text", "image"


class BlockManager:
    def __init__(
        self,
        text_pool: BlockPool,
        image_pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        self.pools = {TEXT: text_pool, IMAGE: image_pool}
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self._flags_cache: dict[str, list[bool]] = {}  # request id -> image_block_flags
        # Partial prompt blocks open to copying: tail hash -> (block, owner request id).
        self._tails: dict[bytes, tuple[int, str]] = {}
        self._tail_of: dict[str, bytes] = {}  # owner request id -> its registered tail hash
        self._tail_seen: set[str] = set()  # requests whose tail was offered (or could not be)
        self._copies: dict[str, tuple[int, int]] = {}  # request id -> (source, its own block)
        self.partial_block_copies = {TEXT: 0, IMAGE: 0}  # by the pool of the copy

    # ---- which pool ----------------------------------------------------------------------------

    def image_block_flags(self, req: Any) -> list[bool]:
        """For each full block inside the prompt: is it made only of image tokens?"""
        bs = self.block_size
        if self.pools[IMAGE].num_blocks == 0:  # no image pool: every block is a text block
            return [False] * (req.num_prompt_tokens // bs)
        is_image = [False] * req.num_prompt_tokens
        for span in req.images:
            mask = span.embed_mask or (True,) * span.length
            is_image[span.offset : span.offset + span.length] = mask
        return [all(is_image[i * bs : (i + 1) * bs]) for i in range(req.num_prompt_tokens // bs)]

    def _flags_for(self, req: Any) -> list[bool]:
        cached = self._flags_cache.get(req.request_id)
        if cached is None:
            cached = self._flags_cache[req.request_id] = self.image_block_flags(req)
        return cached

    def _kinds(self, req: Any, first: int, last: int) -> list[str]:
        flags = self._flags_for(req)
        return [IMAGE if i < len(flags) and flags[i] else TEXT for i in range(first, last)]

    def blocks_needed(self, req: Any, num_tokens: int) -> dict[str, int]:
        """Blocks of each pool that `num_tokens` tokens of this request occupy in total."""
        n_blocks = -(-num_tokens // self.block_size)
        image = sum(self.image_block_flags(req)[:n_blocks])
        return {TEXT: n_blocks - image, IMAGE: image}

    def check_fits(self, req: Any, num_tokens: int) -> None:
        """Refuse (ValueError) a request whose `num_tokens` tokens need more blocks of a pool than
        the pool has: it could never run."""
        for pool, n in self.blocks_needed(req, num_tokens).items():
            if n > self.pools[pool].num_blocks:
                raise ValueError(
                    f"the request needs {n} {pool}-pool blocks but the pool has only "
                    f"{self.pools[pool].num_blocks}; raise kv_cache_memory_bytes or shorten it"
                )

    def pool_of(self, block: int) -> BlockPool:
        return self.pools[IMAGE] if block in self.pools[IMAGE] else self.pools[TEXT]

    # ---- allocation ----------------------------------------------------------------------------

    def new_blocks_for(self, req: Any, num_new_tokens: int) -> dict[str, int]:
        have = len(req.block_table)
        want = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        kinds = self._kinds(req, have, max(have, want))
        return {TEXT: kinds.count(TEXT), IMAGE: kinds.count(IMAGE)}

    def shortfall(self, req: Any, num_new_tokens: int, keep_watermark: bool = False) -> dict[str, int]:
        """Per pool, the blocks missing for `num_new_tokens` more tokens (0 where enough are left)."""
        short = {}
        for name, n in self.new_blocks_for(req, num_new_tokens).items():
            pool = self.pools[name]
            reserve = int(self.watermark * pool.num_blocks) if keep_watermark and n else 0
            short[name] = max(0, n + reserve - pool.num_available)
        return short

    def can_allocate(self, req: Any, num_new_tokens: int, keep_watermark: bool = False) -> bool:
        return not any(self.shortfall(req, num_new_tokens, keep_watermark).values())

    def allocate(self, req: Any, num_new_tokens: int, keep_watermark: bool = False) -> bool:
        """Extend the block table to hold `num_new_tokens` more tokens; all or nothing."""
        if req.num_computed_tokens + num_new_tokens <= len(req.block_table) * self.block_size:
            return True  # most decodes: the last block has room
        if not self.can_allocate(req, num_new_tokens, keep_watermark):
            return False
        have = len(req.block_table)
        want = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        kinds = self._kinds(req, have, max(have, want))
        fresh = {k: iter(self.pools[k].allocate(kinds.count(k))) for k in (TEXT, IMAGE)}
        req.block_table.extend(next(fresh[k]) for k in kinds)
        return True

    def free(self, req: Any) -> None:
        # Tail first: the pools evict least recently released first, so a cached prefix loses its
        # last blocks before its root (a chain whose root is gone can never be matched again).
        rid = req.request_id
        copy = self._copies.pop(rid, None)
        if copy is not None:  # admitted no further: its copy will not run
            self.pool_of(copy[0]).release(copy[0])
            self.partial_block_copies[self.pool_of(copy[1]).name] -= 1
        tail = self._tail_of.pop(rid, None)
        if tail is not None:
            del self._tails[tail]
        self._tail_seen.discard(rid)
        for block in reversed(req.block_table):
            self.pool_of(block).release(block)
        req.block_table = []
        req.num_registered_blocks = 0

    def forget(self, req: Any) -> None:
        """Drop per-request bookkeeping once the request has finished for good."""
        self._flags_cache.pop(req.request_id, None)
        self._tail_seen.discard(req.request_id)

    # ---- prefix reuse --------------------------------------------------------------------------

    def block_hash(self, req: Any, i: int, parent: bytes, end: int | None = None) -> bytes:
        """Block `i`'s content hash; with `end`, of only its positions below `end` (a partial
        block's, which can never equal a full one's)."""
        bs = self.block_size
        lo, hi = i * bs, (i + 1) * bs if end is None else end
        h = hashlib.sha256(parent if end is None else b"partial:" + parent)
        h.update(b",".join(str(t).encode() for t in req.token_ids[lo:hi]))
        for span in req.images:
            a, b = max(lo, span.offset), min(hi, span.offset + span.length)
            if a < b:
                h.update(f"|img:{span.content_hash}:{a - span.offset}:{b - a}".encode())
        return h.digest()

    def match_prefix(self, req: Any, count: bool = True) -> int:
        """Take cached blocks for the longest cached prefix of a request that holds no blocks yet.

        The last token is always left to compute, since its logits are needed. Returns the number of
        tokens taken from cache. `count`: whether the lookups go into the pools' query and hit
        counts (a request probed again while it waits to be admitted is counted once).
        """
        if not self.enable_prefix_caching or req.block_table:
            return 0
        if req.params.prompt_logprobs is not None and req.first_token_time is None:
            return 0  # its prompt's logits are wanted: none can come from the cache
        self._hash_full_blocks(req, upto=(req.num_tokens - 1) // self.block_size)
        for i, h in enumerate(req.block_hashes[: (req.num_tokens - 1) // self.block_size]):
            block = self.pools[self._kinds(req, i, i + 1)[0]].lookup(h, count)
            if block is None:
                break
            req.block_table.append(block)
        req.num_computed_tokens = len(req.block_table) * self.block_size
        req.num_registered_blocks = len(req.block_table)
        self._copy_tail(req)
        return req.num_computed_tokens

    def _tail_hash(self, req: Any) -> bytes | None:
        """Hash of the prompt's last block up to its last token; None when that part is empty."""
        full, end = divmod(req.num_prompt_tokens - 1, self.block_size)
        if end == 0:
            return None
        self._hash_full_blocks(req, upto=full)
        parent = req.block_hashes[full - 1] if full else b""
        return self.block_hash(req, full, parent, full * self.block_size + end)

    def _copy_tail(self, req: Any) -> None:
        """After the full blocks: take a copy of a live request's identical partial prompt block."""
        full = (req.num_prompt_tokens - 1) // self.block_size
        if req.num_tokens != req.num_prompt_tokens or len(req.block_table) != full or not self._tails:
            return
        found = self._tails.get(self._tail_hash(req))
        pool = self.pools[self._kinds(req, full, full + 1)[0]]
        if found is None or pool.num_available == 0:
            return
        src = found[0]
        self.pool_of(src).hold(src)  # not handed to anyone else before the copy has read it
        req.block_table.append(pool.allocate(1)[0])
        req.num_computed_tokens = req.num_prompt_tokens - 1
        self._copies[req.request_id] = (src, req.block_table[-1])
        self.partial_block_copies[pool.name] += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies of the requests admitted since the last call,
        for this step's forward to run first; their sources are let go (the forward runs before
        any later one that could write them)."""
        copies = list(self._copies.values())
        self._copies.clear()
        for src, _ in copies:
            self.pool_of(src).release(src)
        return copies

    def count_lookup(self, req: Any, hit_blocks: int) -> None:
        """Count one lookup of a request in its pools' queries and hits: the `hit_blocks` blocks it
        took from the cache, and the first one it then missed (if it could have taken more)."""
        if not self.enable_prefix_caching:
            return
        probed = min((req.num_tokens - 1) // self.block_size, hit_blocks + 1)
        for i, kind in enumerate(self._kinds(req, 0, probed)):
            self.pools[kind].queries += 1
            self.pools[kind].hits += i < hit_blocks

    def pending_prompt_hashes(self, req: Any) -> list[bytes]:
        """Hashes of the full prompt blocks this request has still to compute (prefix caching on)."""
        if not self.enable_prefix_caching:
            return []
        full = req.num_prompt_tokens // self.block_size
        self._hash_full_blocks(req, upto=full)
        return req.block_hashes[req.num_computed_tokens // self.block_size : full]

    def next_block_hash(self, req: Any) -> bytes | None:
        """Hash of the first full prompt block a request (after `match_prefix`) would compute."""
        pending = self.pending_prompt_hashes(req)
        return pending[0] if pending else None

    def uncommit(self, req: Any, before: int) -> None:
        """Undo a `commit` whose blocks were never written (their forward failed): the blocks it
        registered from `before` on are no longer offered for reuse."""
        for block in req.block_table[before : req.num_registered_blocks]:
            self.pool_of(block).forget(block)
        req.num_registered_blocks = min(req.num_registered_blocks, before)

    def commit(self, req: Any) -> bool:
        """After a step: register the blocks that have just become full, so others can reuse them.
        Whether it offered anything new (to withdraw with `uncommit` if the forward failed)."""
        if not self.enable_prefix_caching:
            return False
        before = req.num_registered_blocks
        full = req.num_computed_tokens // self.block_size
        self._hash_full_blocks(req, upto=full)
        for i in range(req.num_registered_blocks, full):
            block = req.block_table[i]
            self.pool_of(block).register(block, req.block_hashes[i])
        req.num_registered_blocks = max(req.num_registered_blocks, full)
        rid = req.request_id
        if rid not in self._tail_seen and req.num_computed_tokens >= req.num_prompt_tokens - 1:
            self._tail_seen.add(rid)
            tail = self._tail_hash(req)
            if tail is not None and tail not in self._tails:
                self._tails[tail] = (req.block_table[(req.num_prompt_tokens - 1) // self.block_size], rid)
                self._tail_of[rid] = tail
        return req.num_registered_blocks > before

    def restore_row(self, req: Any) -> int | None:
        """A hybrid model's state snapshot a just-matched request starts from (hybrid_blocks.py)."""
        return None

    def plan_snapshots(self, req: Any, start: int, end: int) -> list[tuple[int, int]]:
        """A hybrid model's state snapshots to take in a chunk (hybrid_blocks.py)."""
        return []

    def _hash_full_blocks(self, req: Any, upto: int) -> None:
        while len(req.block_hashes) < upto:
            parent = req.block_hashes[-1] if req.block_hashes else b""
            req.block_hashes.append(self.block_hash(req, len(req.block_hashes), parent))

    # ---- reports -------------------------------------------------------------------------------

    def report(self, requests: list[Any]) -> dict[str, dict[str, Any]]:
        # A block shared by several requests (a reused prefix) holds its slots once: count it once.
        fill: dict[int, int] = {}
        for req in requests:
            for i, block in enumerate(req.block_table):
                n = min(self.block_size, max(0, req.num_computed_tokens - i * self.block_size))
                fill[block] = max(fill.get(block, 0), n)
        filled = {TEXT: 0, IMAGE: 0}
        for block, n in fill.items():
            filled[IMAGE if block in self.pools[IMAGE] else TEXT] += n
        out = {}
        for name, pool in self.pools.items():
            allocated = pool.num_used * self.block_size
            out[name] = {
                "total_blocks": pool.num_blocks,
                "used_blocks": pool.num_used,
                "free_blocks": pool.num_free,
                "cached_blocks": pool.num_cached,
                "allocated_slots": allocated,
                "filled_slots": filled[name],
                "internal_waste": 1.0 - filled[name] / allocated if allocated else 0.0,
                "prefix_cache_queries": pool.queries,
                "prefix_cache_hits": pool.hits,
                "prefix_cache_misses": pool.queries - pool.hits,
                "evictions": pool.evictions,
                # Partial prompt blocks copied from a live request's instead of computed.
                "partial_block_copies": self.partial_block_copies[name],
            }
        return out
