"""The C prefill-attention kernel (`cpu_prefill.c`), called via ctypes: many query tokens per
sequence, K/V read in place through a block table.

Two callers: the torch backend's prefill chunks (causal, straight from the paged pool, where the
torch path gathers each sequence's K/V and runs SDPA over the full square), and a vision tower's
self-attention (`bidirectional`: every patch sees every patch of its image). Each returns None
when the kernel does not apply (not float32 on CPU, a head size it does not take), and the caller
keeps its torch path.
"""

from __future__ import annotations

import ctypes

import torch

from mm_engine.kernels.cpu_build import takes


def paged_prefill(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [tokens, heads, dim], dim contiguous
    k_cache: torch.Tensor,  # [blocks, slots, kv_heads, dim], dim contiguous (any other strides)
    v_cache: torch.Tensor,  # the same strides as k_cache
    tables: torch.Tensor,  # [n, width] block ids
    q_starts: list[int],
    q_lens: list[int],
    seq_lens: list[int],
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    bidir_hi: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor | None:
    """Sequence i's q_lens[i] query rows (from row q_starts[i]) are its last tokens of seq_lens[i];
    with `causal` each sees the keys up to its own position, else all of them; `bidir_hi` (int64
    per query row: an image token's range end, holding the token itself) widens that to the range's
    end, `window` keeps keys above position - window. Returns `[tokens, heads, dim]` (`out` when
    given, contiguous: only those sequences' rows are written), or None when the kernel does not
    apply."""
    if not takes(query, k_cache, v_cache) or k_cache.stride() != v_cache.stride():
        return None
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1:
        return None
    tokens, heads, dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    tables = tables.to(torch.int32).contiguous()
    meta = torch.tensor([q_starts, q_lens, seq_lens], dtype=torch.int32)
    if out is None:
        out = torch.empty(tokens, heads, dim, dtype=query.dtype)
    elif out.shape != query.shape or not out.is_contiguous() or out.dtype != query.dtype:
        return None
    block_stride, slot_stride, head_stride, _ = k_cache.stride()
    if bidir_hi is not None:
        bidir_hi = bidir_hi.to(torch.int64).contiguous()
    status = lib.paged_prefill(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_stride,
        head_stride,
        slot_stride,
        tables.data_ptr(),
        tables.stride(0),
        meta[0].data_ptr(),
        meta[1].data_ptr(),
        meta[2].data_ptr(),
        len(q_lens),
        out.data_ptr(),
        heads,
        kv_heads,
        block_size,
        dim,
        scale,
        int(causal),
        None if bidir_hi is None else bidir_hi.data_ptr(),
        window or 0,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def varlen(lib: ctypes.CDLL, query, key, value, starts, lens, scale: float) -> torch.Tensor | None:
    """Full attention within each segment of packed rows (a vision tower's images or windows):
    `[tokens, heads, dim]` each, any row and head strides (views into one QKV output), segment i
    rows `starts[i]` .. `+ lens[i]`; `[tokens, heads, dim]` out, contiguous; None where the kernel
    does not apply. K and V are read as overlapping one-row-apart "blocks": block `starts[i]` is
    segment i's first row, and a block is as long as the longest segment (the kernel takes the
    block size and strides of its K/V, never their block count)."""
    if not takes(query, key, value) or key.stride() != value.stride() or key.shape != query.shape:
        return None
    if query.stride(-1) != 1 or key.stride(-1) != 1 or not lens:
        return None
    tokens, heads, dim = key.shape
    row, head, _ = key.stride()
    longest = max(lens)
    k = key.as_strided((1, longest, heads, dim), (row, row, head, 1))
    v = value.as_strided((1, longest, heads, dim), (row, row, head, 1))
    tables = torch.tensor(starts, dtype=torch.int32)[:, None]
    return paged_prefill(lib, query, k, v, tables, list(starts), list(lens), list(lens), scale, causal=False)
