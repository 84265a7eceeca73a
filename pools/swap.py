"""Host-memory swap space for preempted requests (`preemption_mode="swap"`).

Swapping out copies a request's KV blocks to host memory so it can resume without recomputing.
Space is bounded by `swap_space_bytes`. Image KV is the costly kind to recompute (vision encoder
plus a long prefill), so when space runs short a request holding image blocks may push out the
host copies of requests that hold none; those fall back to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_engine.pools.kv_cache import KVCache


@dataclass(slots=True)
class SwappedKV:
    k: list[torch.Tensor]  # per layer [n_blocks, block_size, kv_heads, head_dim], on host
    v: list[torch.Tensor]
    num_computed_tokens: int
    has_image_blocks: bool
    nbytes: int


class HostSwap:
    def __init__(self, kv: KVCache, capacity_bytes: int) -> None:
        self.kv = kv
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._store: dict[str, SwappedKV] = {}  # request id -> its KV on host, oldest first
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    def has(self, request_id: str) -> bool:
        return request_id in self._store

    def swap_out(
        self, request_id: str, blocks: list[int], num_computed: int, has_image_blocks: bool,
        protect: str | None = None,
    ) -> bool:  # fmt: skip
        """Copy the blocks to host; False when there is no room (the caller recomputes instead).
        Image KV may push out stored text KV, but never `protect`'s (a request being swapped in)."""
        nbytes = len(blocks) * self.kv.spec.bytes_per_block
        if nbytes == 0 or nbytes > self.capacity_bytes:
            return False
        if self.used_bytes + nbytes > self.capacity_bytes and has_image_blocks:
            for rid in [r for r, s in self._store.items() if not s.has_image_blocks and r != protect]:
                self.drop(rid)
                if self.used_bytes + nbytes <= self.capacity_bytes:
                    break
        if self.used_bytes + nbytes > self.capacity_bytes:
            return False
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        k = [layer.index_select(0, idx).to("cpu") for layer in self.kv.k]
        v = [layer.index_select(0, idx).to("cpu") for layer in self.kv.v]
        self._store[request_id] = SwappedKV(k, v, num_computed, has_image_blocks, nbytes)
        self.used_bytes += nbytes
        self.swapped_out_blocks += len(blocks)
        return True

    def num_computed(self, request_id: str) -> int:
        return self._store[request_id].num_computed_tokens

    def swap_in(self, request_id: str, table: list[int]) -> None:
        """Copy a request's KV back into the leading blocks of its freshly allocated block table."""
        s = self._store.pop(request_id)
        self.used_bytes -= s.nbytes
        blocks = table[: s.k[0].shape[0]]
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        for layer, saved in zip(self.kv.k, s.k, strict=True):
            layer.index_copy_(0, idx, saved.to(layer.device))
        for layer, saved in zip(self.kv.v, s.v, strict=True):
            layer.index_copy_(0, idx, saved.to(layer.device))
        self.swapped_in_blocks += len(blocks)

    def drop(self, request_id: str) -> None:
        s = self._store.pop(request_id, None)
        if s is not None:
            self.used_bytes -= s.nbytes
