"""The C K/V write for the CPU pool (`cpu_kv_write.c`), called via ctypes: a step's new key and
value rows copied into their slots, in place of torch's `index_put_` (about 60 us a call for a
decode step's 64 rows, a few microseconds as plain copies). kernels/cpu_build.py builds it."""

from __future__ import annotations

import ctypes

import torch

from mm_engine.kernels.cpu_build import takes


def write_kv(
    lib: ctypes.CDLL,
    key: torch.Tensor,  # [tokens, kv_heads, dim], rows contiguous (any token and head stride)
    value: torch.Tensor,
    k_cache: torch.Tensor,  # the pool's [blocks, slots, kv_heads, dim] view
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [tokens]; below zero: skipped. The caller checks the range.
) -> bool:
    """Write in place; False (nothing written) where the kernel does not apply: not float32 on
    CPU, or a layout it does not take. The caller then takes the torch path."""
    if (
        not takes(key, value, k_cache, v_cache)
        or key.dim() != 3
        or value.shape != key.shape
        or slot_mapping.dtype != torch.int64
    ):
        return False
    tokens, kv_heads, dim = key.shape
    if (
        key.stride(2) != 1
        or value.stride(2) != 1
        or k_cache.stride() != v_cache.stride()
        or k_cache.stride(3) != 1
    ):
        return False
    if k_cache.shape[2:] != (kv_heads, dim) or v_cache.shape != k_cache.shape:
        return False
    if (
        slot_mapping.device.type != "cpu"
        or slot_mapping.shape != (tokens,)
        or not slot_mapping.is_contiguous()
    ):
        return False
    lib.write_kv(
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        slot_mapping.data_ptr(),
        tokens,
        kv_heads,
        dim,
        k_cache.shape[1],
        torch.get_num_threads(),
    )
    return True
