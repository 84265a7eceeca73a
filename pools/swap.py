"""Host-memory swap space for preempted requests (`preemption_mode="swap"`).

Swapping out copies a request's KV blocks to host memory so it can resume without recomputing.
Space is bounded by `swap_space_bytes`. Image KV is the costly kind to recompute (vision encoder
plus a long prefill), so when space runs short a request holding image blocks may push out the
host copies of requests that hold none; those fall back to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mm_engine.pools.kv_cache import KVCache
from mm_engine.pools.state_pool import StatePool


@dataclass(slots=True)
class SwappedKV:
    k: list[torch.Tensor]  # per layer [n_blocks, block_size, kv_heads, head_dim], on host
    v: list[torch.Tensor]
    num_computed_tokens: int
    has_image_blocks: bool
    nbytes: int
    state: list[torch.Tensor] | None = None  # a hybrid model's state slot (StatePool.save)


class SwapMirror(Protocol):
    """Where the same swaps are repeated (tensor-parallel workers, each for its own KV heads)."""

    def swap_out(self, request_id: str, blocks: list[int], state_slot: int | None = None) -> None: ...
    def swap_in(self, request_id: str, blocks: list[int], state_slot: int | None = None) -> None: ...
    def drop(self, request_id: str) -> None: ...


class HostSwap:
    def __init__(
        self,
        kv: KVCache,
        capacity_bytes: int,
        mirror: SwapMirror | None = None,
        states: StatePool | None = None,
    ) -> None:
        """`states`: a hybrid model's state pool; a request's slot travels with its KV."""
        self.kv = kv
        self.states = states
        self.mirror = mirror
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._store: dict[str, SwappedKV] = {}  # request id -> its KV on host, oldest first
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    def has(self, request_id: str) -> bool:
        return request_id in self._store

    def swap_out(
        self, request_id: str, blocks: list[int], num_computed: int, has_image_blocks: bool,
        protect: str | None = None, state_slot: int | None = None,
    ) -> bool:  # fmt: skip
        """Copy the blocks to host; False when there is no room (the caller recomputes instead).
        Image KV may push out stored text KV, but never `protect`'s (a request being swapped in)."""
        nbytes = len(blocks) * self.kv.spec.bytes_per_block
        with_state = self.states is not None and state_slot is not None
        if with_state:
            nbytes += self.states.spec.bytes_per_slot
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
        state = self.states.save(state_slot) if with_state else None
        self._store[request_id] = SwappedKV(k, v, num_computed, has_image_blocks, nbytes, state)
        self.used_bytes += nbytes
        self.swapped_out_blocks += len(blocks)
        if self.mirror is not None:
            self.mirror.swap_out(request_id, list(blocks), state_slot if with_state else None)
        return True

    def num_computed(self, request_id: str) -> int:
        return self._store[request_id].num_computed_tokens

    def swap_in(self, request_id: str, table: list[int], state_slot: int | None = None) -> None:
        """Copy a request's KV back into the leading blocks of its freshly allocated block table
        (and its recurrent state into its new slot)."""
        s = self._store.pop(request_id)
        if s.state is not None:
            self.states.load(state_slot, s.state)
        self.used_bytes -= s.nbytes
        blocks = table[: s.k[0].shape[0]]
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        for layer, saved in zip(self.kv.k, s.k, strict=True):
            layer.index_copy_(0, idx, saved.to(layer.device))
        for layer, saved in zip(self.kv.v, s.v, strict=True):
            layer.index_copy_(0, idx, saved.to(layer.device))
        self.swapped_in_blocks += len(blocks)
        if self.mirror is not None:
            self.mirror.swap_in(request_id, list(blocks), state_slot if s.state is not None else None)

    def drop(self, request_id: str) -> None:
        s = self._store.pop(request_id, None)
        if s is not None:
            self.used_bytes -= s.nbytes
            if self.mirror is not None:
                self.mirror.drop(request_id)


class MirroredSwap:
    """A worker's side of `HostSwap`: the same swaps on its own KV heads (and share of the
    recurrent state), as rank 0 decides them."""

    def __init__(self, kv: KVCache, states: StatePool | None = None) -> None:
        self.kv, self.states = kv, states
        self._store: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]] = {}

    def swap_out(self, request_id: str, blocks: list[int], state_slot: int | None = None) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        self._store[request_id] = (
            [layer.index_select(0, idx).to("cpu") for layer in self.kv.k],
            [layer.index_select(0, idx).to("cpu") for layer in self.kv.v],
            self.states.save(state_slot) if state_slot is not None else None,
        )

    def swap_in(self, request_id: str, blocks: list[int], state_slot: int | None = None) -> None:
        k, v, state = self._store.pop(request_id)
        if state is not None:
            self.states.load(state_slot, state)
        idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.k[0].device)
        for layers, saved in ((self.kv.k, k), (self.kv.v, v)):
            for layer, host in zip(layers, saved, strict=True):
                layer.index_copy_(0, idx, host.to(layer.device))

    def drop(self, request_id: str) -> None:
        self._store.pop(request_id, None)
