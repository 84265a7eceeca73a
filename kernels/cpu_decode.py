"""The C decode-attention kernel for the CPU pool (`cpu_decode.c`), called via ctypes.

The kernel reads each sequence's K/V straight from the pool, where the torch path first gathers a
padded copy, which costs a copy of the context per layer (docs/cpu.md). It takes the library of one ISA
variant (kernels/cpu_build.py).
"""

from __future__ import annotations

import ctypes

import torch

from mm_engine.kernels.cpu_build import takes

# The head shapes the kernel takes (cpu_decode.c's MAX_GROUP, MAX_DIM): query heads per KV head, head size.
MAX_GROUP, MAX_DIM = 16, 256


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [n, heads, dim]
    k_cache: torch.Tensor,  # the pool's [blocks, slots, kv_heads, dim] view of head-major storage
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [n, width] int32
    lens: torch.Tensor,  # [n] int32
    max_len: int,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one query per sequence, or None when the kernel does not apply here (not
    built, not float32, not the pool's layout); the caller then takes the torch path."""
    if not takes(q, k_cache, v_cache) or not (
        k_cache.transpose(1, 2).is_contiguous() and v_cache.transpose(1, 2).is_contiguous()
    ):
        return None
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    tables = tables.to(torch.int32).contiguous()
    lens = lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        block_size,
        dim,
        scale,
        max_len,
        torch.get_num_threads(),
    )
    return out if status == 0 else None
