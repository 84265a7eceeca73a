"""The C prefill-attention kernel (`cpu_prefill.c`), called via ctypes: many query tokens per
sequence, K/V read in place through a block table.

Two callers: the torch backend's prefill chunks (causal, straight from the paged pool, where the
torch path gathers each sequence's K/V and runs SDPA over the full square), and the vision tower's
self-attention (`vision_attention`, registered with transformers: every patch sees every patch).
Each returns None when the kernel does not apply (not built, not float32 on CPU, a head size it
does not take), and the caller keeps its torch path.
"""

from __future__ import annotations

import torch

from mm_engine.kernels import cpu_build

NAME = "mm_engine_cpu"  # the vision tower's attention implementation, as transformers knows it


def paged_prefill(
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
) -> torch.Tensor | None:
    """Sequence i's q_lens[i] query rows (from row q_starts[i]) are its last tokens of seq_lens[i];
    with `causal` each sees the keys up to its own position, else all of them. Returns `[tokens,
    heads, dim]` (`out` when given, contiguous: only those sequences' rows are written), or None
    when the kernel does not apply."""
    lib = cpu_build.lib_for(query, k_cache, v_cache)
    if lib is None or k_cache.stride() != v_cache.stride():
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
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def vision_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: `[batch, heads, tokens, dim]` in, `([batch,
    tokens, heads, dim], None)` out. Each image is one sequence and one "block" of the kernel;
    anything it does not take (a mask, dropout, causal, half precision) goes to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, tokens, dim = query.shape
    plain = attention_mask is None and not dropout and not kwargs.get("is_causal")
    out = None
    if plain and cpu_build.lib_for(query, key, value) and key.shape == value.shape == query.shape:
        scale = dim**-0.5 if scaling is None else scaling
        per_image = [tokens] * batch
        tables = torch.arange(batch, dtype=torch.int32)[:, None]
        q = query.transpose(1, 2).reshape(batch * tokens, heads, dim)  # a view for [B, T, H, D] storage
        k, v = key.transpose(1, 2), value.transpose(1, 2)  # [images, tokens, heads, dim] as the pool's view
        if k.stride() == v.stride():
            starts = [b * tokens for b in range(batch)]
            out = paged_prefill(q, k, v, tables, starts, per_image, per_image, scale, causal=False)
    if out is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    return out.view(batch, tokens, heads, dim), None


def use_for_vision(tower) -> bool:
    """Route a transformers vision tower's self-attention through `vision_attention` (where the
    kernel does not apply it still falls back to SDPA per call); False when it cannot be built."""
    if cpu_build.load() is None:
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, vision_attention)
    tower.set_attn_implementation(NAME)
    return True
