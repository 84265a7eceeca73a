"""What an attention backend needs to know about one varlen batch.

The batch is flat: the new tokens of every scheduled sequence, one after the other. Sequence `i`
owns query rows `query_start_loc[i]:query_start_loc[i + 1]`; those tokens sit at the end of its
`seq_lens[i]` tokens, so the first `seq_lens[i] - query_len` tokens are cached context that the
queries attend to in full, and the new tokens attend to each other causally. A decode is simply a
sequence with one new token.

KV layout (shared by every backend): per layer one K tensor and one V tensor of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token `t` of sequence `i` lives in block
`block_tables[i, t // block_size]` at offset `t % block_size`; its flat slot is
`block * block_size + offset`. Image-pool and text-pool blocks are indices into the same tensor.

Two departures from causal attention, both optional: `bidirectional` gives each new token a range
`[start, end)` of positions it also sees (Gemma 3: the tokens of one image see each other in both
directions; outside images the range is empty), and a layer may pass a sliding `window` to
`attend` (a query at position p sees keys at positions > p - window).

A vision tower's attention needs much less (`Segments`): runs of packed rows that see each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [batch + 1], cumulative query lengths
    seq_lens: torch.Tensor  # int32 [batch], context + new tokens
    block_tables: torch.Tensor  # int32 [batch, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens], flat slot each new token's K/V goes to
    max_query_len: int
    max_seq_len: int
    # Host copies, so a backend that loops over sequences never syncs with the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # int64 [num_tokens] each, positions: what each new token sees besides the causal prefix.
    bidirectional: tuple[torch.Tensor, torch.Tensor] | None = None
    # Hybrid models: each sequence's slot in the recurrent-state pool (pools/state_pool.py).
    state_slots_cpu: list[int] | None = None
    # ... and per sequence, the points of its chunk whose state also goes to a snapshot row:
    # (tokens into the chunk, row). None: no snapshot this step.
    state_snapshots_cpu: list[list[tuple[int, int]]] | None = None
    # What a backend works out from the batch (which sequences are decodes, their index tensors),
    # worked out by the first layer and kept here for the others: it is the same for all of them.
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True, slots=True)
class Segments:
    """Contiguous runs of rows that attend among themselves: `starts[i]`, `lens[i]`; `windows`:
    they are windows of an image (short, many), not whole frames (the ops pick a kernel by it)."""

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    windows: bool = False

    @staticmethod
    def of(lens: list[int], windows: bool = False) -> Segments:
        starts, at = [], 0
        for n in lens:
            starts.append(at)
            at += n
        return Segments(tuple(starts), tuple(lens), windows)
