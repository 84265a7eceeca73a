"""What one step's forward is given: `StepInputs`, the tensors on the device, built by the runner
from `StepRows`, the same inputs on the host as it walks the batch row by row. Tensor parallelism
sends `StepInputs` to the other ranks (parallel/step_wire.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mm_engine.kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    """One step's forward inputs, prepared on the host and already on the device."""

    ids: torch.Tensor  # [tokens] (image positions zeroed: their embeddings are replaced)
    positions: torch.Tensor  # [tokens], or [3, tokens] for M-RoPE
    meta: AttentionMetadata
    embed_rows: torch.Tensor | None  # flat rows that take vision embeddings
    embed_feats: torch.Tensor | None  # [rows, 1 + deepstack, hidden]
    sample_rows: list[int]  # flat rows whose logits are sampled
    sampling: list[int]  # the batch items they belong to
    # Flat rows whose id is the previous step's sampled token, and that token's index among the
    # previous step's samples; None when no input is pending.
    from_prev: tuple[torch.Tensor, torch.Tensor] | None = None
    # Prompt logprobs: flat rows whose logits are wanted besides the sampled ones (after them in
    # the logits), and per request (item, first prompt position, count) of those rows.
    extra_rows: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    logit_rows: torch.Tensor | None = None  # sample_rows + extra_rows on the device (no host sync)
    block_copies: tuple[torch.Tensor, torch.Tensor] | None = None  # (sources, destinations), first
    state_copies: tuple[torch.Tensor, torch.Tensor] | None = None  # state rows (snapshot -> slot), first


@dataclass(slots=True)
class StepRows:
    """One step's inputs on the host, row by row, while `_prepare` walks the batch."""

    ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each row's KV slot
    positions: list[int] = field(default_factory=list)  # 1-D rotary positions, one list (cheaper per row)
    mrope_positions: list[torch.Tensor] = field(default_factory=list)  # [3, n] per request (M-RoPE)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    sampling: list[int] = field(default_factory=list)  # the batch items they belong to
    prev_rows: list[int] = field(default_factory=list)  # rows whose id is still on the device
    prev_src: list[int] = field(default_factory=list)  # its index among the previous step's samples
    embed_rows: list[torch.Tensor] = field(default_factory=list)  # rows that take vision embeddings
    embed_feats: list[torch.Tensor] = field(default_factory=list)  # and those, [rows, 1 + deepstack, hidden]
    bidirectional: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (rows, image lo, hi)
    extra_rows: list[int] = field(default_factory=list)  # prompt-logprob rows, after the sampled ones
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)  # (item, first position, count)
