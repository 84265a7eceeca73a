"""Paged attention in Triton: one launch for a varlen batch that mixes prefill chunks and decodes.

A program owns one tile of new tokens of one sequence and one KV head. Its rows are (token, query
head) pairs covering every query head that shares that KV head (grouped-query attention), so each
K/V tile is loaded once per KV head and reused by the whole group. It walks the sequence's keys in
tiles of BLOCK_N tokens through the block table, with an online softmax whose running max and sum
stay in float32. Scores are kept in base 2 (scale folded with log2(e)) so the kernel uses exp2.

Split-KV (flash-decoding): with NUM_SPLITS > 1 a third grid axis cuts each key range into segments
of `seg_len` keys. Each program writes its normalized partial output and the log-sum-exp of its
scores; `_merge_splits_kernel` then weighs the partials by their LSE. This keeps the GPU busy when a
decode batch has few, long sequences and the plain grid would leave most SMs idle.

Two optional departures from causal attention (AttentionMetadata): with `bidirectional`, each new
token also sees the positions `[lo, hi)` of its row (an image's tokens see each other; the key
range of a tile grows to the largest `hi` of its rows), and with a sliding `window` a query at
position p sees only keys above p - window (the tile starts its key walk there).

A vision tower's packed attention runs on the same kernel (kernels/triton_varlen.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mm_engine.kernels.metadata import AttentionMetadata


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,  # float32 [NUM_SPLITS, num_tokens, num_heads, HEAD_DIM], split path only
    part_lse_ptr,  # float32 [NUM_SPLITS, num_tokens, num_heads], split path only
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    bidir_lo_ptr,  # int64 [num_tokens]: with HAS_BIDIR, the positions each token sees both ways
    bidir_hi_ptr,
    window,  # with HAS_WINDOW: keys at positions > q_pos - window
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    num_q_tiles,
    seg_len,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_BIDIR: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0) // num_q_tiles
    q_start = (tl.program_id(0) % num_q_tiles) * BLOCK_Q
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    if q_start >= q_len:  # the grid is sized for the longest query; shorter ones stop here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = q_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (tok < q_len) & (head_in_group < GROUP)
    q_pos = ctx_len + tok
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM

    tok_global = (q_begin + tok).to(tl.int64)
    q_ptrs = q_ptr + tok_global[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Causality: the tile's last row sees keys up to its own position, no row sees further.
    kv_hi = tl.minimum(seq_len, ctx_len + q_start + BLOCK_Q)
    kv_lo = 0
    if HAS_BIDIR:  # ... except an image's rows, which see up to their image's end
        b_lo = tl.load(bidir_lo_ptr + tok_global, mask=row_valid, other=0)
        b_hi = tl.load(bidir_hi_ptr + tok_global, mask=row_valid, other=0)
        kv_hi = tl.minimum(seq_len, tl.maximum(kv_hi, tl.max(b_hi, 0).to(tl.int32)))
    if HAS_WINDOW:  # the tile's first row sees nothing at or below its position - window
        kv_lo = tl.maximum(ctx_len + q_start - window + 1, 0)
    if NUM_SPLITS > 1:
        kv_lo = tl.maximum(kv_lo, split * seg_len)
        kv_hi = tl.minimum(kv_hi, split * seg_len + seg_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head64 = kv_head.to(tl.int64)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_hi
        # 64-bit from here on: block * stride overflows int32 in caches of > 2^31 elements.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        offset = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k_off = block * stride_kb + offset * stride_ks + kv_head64 * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        seen = pos[None, :] <= q_pos[:, None]
        if HAS_BIDIR:
            seen = seen | ((pos[None, :] >= b_lo[:, None]) & (pos[None, :] < b_hi[:, None]))
        if HAS_WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        visible = pos_valid[None, :] & seen
        s = tl.where(visible, s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + offset * stride_vs + kv_head64 * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0  # false only for padding rows and empty split segments
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + tok_global[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        split64 = split.to(tl.int64)
        p_ptrs = (
            part_out_ptr
            + split64 * stride_ps
            + tok_global[:, None] * stride_pt
            + head[:, None] * stride_ph
            + dims[None, :]
        )
        tl.store(p_ptrs, out, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        l_ptrs = part_lse_ptr + split64 * stride_ls + tok_global * stride_lt + head
        tl.store(l_ptrs, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    lse = tl.load(
        part_lse_ptr + splits * stride_ls + tok * stride_lt + head, mask=split_valid, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # empty segments have LSE -inf and weigh 0
    part_mask = split_valid[:, None] & (dims < HEAD_DIM)[None, :]
    parts = tl.load(
        part_out_ptr + splits[:, None] * stride_ps + tok * stride_pt + head * stride_ph + dims[None, :],
        mask=part_mask,
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_ptrs = out_ptr + tok * stride_ot + head * stride_oh + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _tile_config(head_pad: int, elt: int, group_pad: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps). Rows = BLOCK_Q tokens x GROUP_PAD query heads.

    Tiles shrink as head rows grow so Q plus two pipeline stages of K and V stay near 96 KiB of
    shared memory (128 x 64 tiles at fp16 and head 128), which every recent NVIDIA GPU has.
    """
    row_bytes = head_pad * elt
    block_n = 64 if row_bytes <= 256 else (32 if row_bytes <= 512 else 16)
    min_q = max(16 // group_pad, 1)  # tl.dot needs at least 16 rows
    if max_query_len == 1:  # decode-only: one token per sequence, the fewest rows that tl.dot takes
        return min_q, block_n, 4
    max_m = 128 if row_bytes <= 256 else (64 if row_bytes <= 512 else 32)
    block_q = max(min(max_m // group_pad, triton.next_power_of_2(max_query_len)), min_q)
    return block_q, block_n, 8 if block_q * group_pad >= 128 else 4


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the batch's new queries `[num_tokens, num_heads, head_dim]` over the paged K/V.

    `num_splits` > 1 takes the split-KV path with that many key segments per sequence; it works for
    any batch, prefill included, though the backend only picks it for long decodes.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads {num_heads}x{head_dim} do not fit cache heads {num_kv_heads}x{cache_head_dim}"
        )
    if not query.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"query {query.dtype} and KV cache {k_cache.dtype}/{v_cache.dtype} dtypes differ")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must have the query's shape and a contiguous head dimension")
    block_tables = meta.block_tables
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(triton.next_power_of_2(head_dim), 16)
    block_q, block_n, num_warps = _tile_config(head_pad, query.element_size(), group_pad, meta.max_query_len)
    seg_len = triton.cdiv(triton.cdiv(max(meta.max_seq_len, 1), num_splits), block_n) * block_n
    if num_splits > 1:
        part_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
    else:  # unused by the kernel, but it needs tensors and strides to bind
        part_out = out
        part_lse = out
    num_q_tiles = triton.cdiv(meta.max_query_len, block_q)
    bidir = meta.bidirectional
    b_lo, b_hi = bidir if bidir is not None else (meta.slot_mapping, meta.slot_mapping)  # unread

    grid = (meta.num_seqs * num_q_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        meta.query_start_loc,
        meta.seq_lens,
        block_tables,
        b_lo,
        b_hi,
        window or 0,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        num_q_tiles,
        seg_len,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        # float32 inputs get exact float32 products (as torch does by default), not TF32.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        HAS_BIDIR=bidir is not None,
        HAS_WINDOW=window is not None,
        num_warps=num_warps,
        num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
