"""Triton kernel that writes a step's new K/V into their cache slots.

One program per (token, KV head) copies one head vector of K and one of V. A negative slot means
"do not write" (padding tokens, or tokens whose K/V is already cached), so those programs only mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)  # int64: slots of big caches do not fit in 32 bits
    dims = tl.arange(0, HEAD_PAD)
    mask = (dims < HEAD_DIM) & (slot >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any token/head strides
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], negative = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"K/V {tuple(key.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < num_tokens:
        raise ValueError("slot_mapping must be int64 with one slot per token")
    if num_tokens == 0:
        return
    # Views out of a fused QKV projection are fine as long as the head dimension is contiguous.
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 128 else 2,
    )
