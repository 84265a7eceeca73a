"""The recurrent-state pool of hybrid models (Qwen3.5): one fixed-size slot per running sequence.

A linear-attention layer keeps no per-token KV; each sequence carries, per such layer, the causal
conv's last `kernel - 1` inputs and the gated delta rule's state `[value heads, key dim, value
dim]`. A slot holds both for every linear layer. A sequence takes a slot when it is admitted and
gives it back when it finishes, is aborted or is preempted (recompute starts over from a zero
state; swap copies the slot to host with the KV, `save` / `load`). Every running sequence holds
exactly one slot, so the scheduler's seat limit is at most the slot count (`max_num_seqs`).

The recurrent state is float32 whatever the model's dtype (it accumulates over the whole
sequence); the conv state is in the model's dtype, like the inputs it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class StateSpec:
    num_layers: int  # linear-attention layers
    conv_channels: int  # q, k and v side by side
    conv_kernel: int
    num_heads: int  # value heads
    key_dim: int
    value_dim: int
    dtype: torch.dtype  # of the conv state

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_channels * (self.conv_kernel - 1) * torch.empty((), dtype=self.dtype).element_size()
        recurrent = self.num_heads * self.key_dim * self.value_dim * 4
        return self.num_layers * (conv + recurrent)


class StatePool:
    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device, num_snapshots: int = 0) -> None:
        """`num_snapshots`: rows after the slots that keep snapshots for prefix reuse
        (state_snapshots.py manages them; the forward writes and restores them)."""
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.spec = spec
        self.num_slots = num_slots
        self.snapshot_rows = range(num_slots, num_slots + num_snapshots)
        rows, k = num_slots + num_snapshots, spec.conv_kernel - 1
        self.conv = [
            torch.zeros(rows, spec.conv_channels, k, dtype=spec.dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        shape = (rows, spec.num_heads, spec.key_dim, spec.value_dim)
        self.recurrent = [
            torch.zeros(shape, dtype=torch.float32, device=device) for _ in range(spec.num_layers)
        ]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: dict[int, str] = {}

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, req: Any) -> None:
        """Give `req` a slot (`req.state_slot`). Its contents are stale: the forward starts a
        sequence with no computed tokens from zeros, and swap-in overwrites it."""
        if req.state_slot is not None:
            return
        if not self._free:
            raise RuntimeError("no free state slot (the scheduler admits at most one sequence per slot)")
        slot = self._free.pop()
        self._owner[slot] = req.request_id
        req.state_slot = slot

    def free(self, req: Any) -> None:
        slot = req.state_slot
        if slot is None:
            return
        if self._owner.pop(slot, None) != req.request_id:
            raise RuntimeError(f"state slot {slot} is not held by request {req.request_id!r}")
        self._free.append(slot)
        req.state_slot = None

    def save(self, slot: int) -> list[torch.Tensor]:
        """A slot's contents on host (swap-out): conv then recurrent state of every layer."""
        return [t[slot].to("cpu", copy=True) for t in (*self.conv, *self.recurrent)]

    def load(self, slot: int, saved: list[torch.Tensor]) -> None:
        for t, host in zip((*self.conv, *self.recurrent), saved, strict=True):
            t[slot].copy_(host)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows `src[i]` -> `dst[i]` in every layer (a snapshot into a slot), in stream order."""
        for t in (*self.conv, *self.recurrent):
            t.index_copy_(0, dst, t.index_select(0, src))

    def report(self) -> dict[str, int]:
        return {
            "slots": self.num_slots,
            "used": self.num_used,
            "free": self.num_free,
            "bytes_per_slot": self.spec.bytes_per_slot,
            "bytes": (self.num_slots + len(self.snapshot_rows)) * self.spec.bytes_per_slot,
        }
