"""Grouped expert matmuls in Triton (the CUDA path of models/layers/moe.py's experts).

The (token, expert) pairs arrive sorted by expert. Each expert's run of pairs is padded to whole
row tiles, so every tile belongs to one expert: a program takes one tile and one block of output
columns, reads its expert's weight, and gathers its input rows by index, so the tokens are never
copied into expert order. Two launches per layer: gate-and-up (then SiLU-and-multiply), and down.
The tile map is built on the device from the sorted expert ids, with no host sync: there are at
most `ceil(pairs / BLOCK_M) + experts` tiles, and the unused ones exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # decode sends a handful of tokens per expert: small row tiles waste little


@triton.jit
def _grouped_matmul_kernel(
    a, src, dst, tile_expert, w, out, n_cols, n_inner,
    stride_a, stride_we, stride_wk, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tile, nb = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert + tile)
    if expert < 0:
        return
    pos = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(src + pos)  # -1: padding
    valid = rows >= 0
    rows = tl.where(valid, rows, 0).to(tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    weight = w + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_inner, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < n_inner
        x = tl.load(
            a + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        y = tl.load(
            weight + ks[:, None] * stride_wk + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        acc += tl.dot(x, y, input_precision=DOT_PRECISION)
    to = tl.load(dst + pos, mask=valid, other=0).to(tl.int64)
    mask = valid[:, None] & col_ok[None, :]
    tl.store(out + to[:, None] * stride_out + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


def _tiles(expert: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From the sorted expert id of each pair: `where` `[padded]`, the pair each padded row
    holds (-1: padding), and `tile_expert` `[tiles]` (-1: unused tile)."""
    pairs = expert.shape[0]
    device = expert.device
    counts = torch.bincount(expert, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = torch.cumsum(counts, 0) - counts  # each expert's first pair
    padded_starts = torch.cumsum(padded, 0) - padded  # ... and first padded row
    tiles = triton.cdiv(pairs, BLOCK_M) + num_experts
    index = torch.arange(pairs, device=device)
    position = padded_starts[expert] + index - starts[expert]
    where = torch.full((tiles * BLOCK_M,), -1, dtype=torch.int64, device=device)
    where[position] = index
    tile_ends = torch.cumsum(padded // BLOCK_M, 0)
    tile_expert = torch.searchsorted(tile_ends, torch.arange(tiles, device=device), right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return where, tile_expert


def _matmul(a, src, dst, tile_expert, w, rows: int) -> torch.Tensor:
    n_inner, n_cols = w.shape[1:]
    out = torch.empty(rows, n_cols, dtype=a.dtype, device=a.device)
    block_n = min(64, triton.next_power_of_2(n_cols))
    block_k = min(64, max(16, triton.next_power_of_2(n_inner)))
    grid = (tile_expert.shape[0], triton.cdiv(n_cols, block_n))
    _grouped_matmul_kernel[grid](
        a, src, dst, tile_expert, w, out, n_cols, n_inner,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M, block_n, block_k, "ieee" if a.dtype == torch.float32 else None,
    )  # fmt: skip
    return out


def grouped_experts(
    x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, silu_and_mul,
) -> torch.Tensor:  # fmt: skip
    """TorchOps.moe_experts's contract: the output of pair i's expert on its token, `[pairs,
    hidden]` in sorted-pair order. `gate_up` `[experts, hidden, 2 x width]`, `down` `[experts,
    width, hidden]`, both with unit column stride."""
    pairs = token.shape[0]
    if pairs == 0:
        return x.new_empty(0, down.shape[-1])
    where, tile_expert = _tiles(expert, gate_up.shape[0])
    pair = torch.where(where >= 0, where, -1)
    source = torch.where(where >= 0, token[where.clamp(min=0)], -1)  # the token of each padded row
    x = x.contiguous()
    hidden = silu_and_mul(_matmul(x, source, pair, tile_expert, gate_up, pairs))
    return _matmul(hidden, pair, pair, tile_expert, down, pairs)
