"""Fused elementwise passes in C (`cpu_elementwise.c`) for the CPU path, called via ctypes:
SiLU-and-multiply for the decoder MLPs, an in-place tanh-GELU for a SigLIP vision tower's MLPs,
RMSNorm with the residual add folded in, the gated RMSNorm of a linear-attention layer, and rotary
embedding in place.

Each takes the kernel library of one ISA variant (`cpu_build.load`) and returns None (or False)
where the kernel does not apply (not float32 on CPU, an odd layout); the caller keeps its torch
path. kernels/ops.py decides where they are used.
"""

from __future__ import annotations

import ctypes

import torch

from mm_engine.kernels.cpu_build import takes


def rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(x, rms_norm(x) * weight)` over the last dim, with delta first added to x in place (the
    residual stream, which only the forward pass holds); None where the kernel does not apply,
    and then x is untouched."""
    tensors = (x, weight) if delta is None else (x, weight, delta)
    if not takes(*tensors) or not all(t.is_contiguous() for t in tensors):
        return None
    if delta is not None and delta.shape != x.shape:
        return None
    cols = x.shape[-1]
    out = torch.empty_like(x)
    d_ptr = None if delta is None else delta.data_ptr()
    rows = x.numel() // max(cols, 1)
    lib.rms_norm(
        x.data_ptr(),
        d_ptr,
        x.data_ptr(),  # the sum, row by row over the row it reads
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return x, out


def gated_rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """`rms_norm(x) * weight * silu(gate)` over the last dim of `[rows, cols]` x and gate; None
    where the kernel does not apply."""
    if not takes(x, gate, weight) or not all(t.is_contiguous() for t in (x, gate, weight)):
        return None
    if gate.shape != x.shape or x.dim() != 2:
        return None
    out = torch.empty_like(x)
    rows, cols = x.shape
    ptrs = (x.data_ptr(), gate.data_ptr(), weight.data_ptr(), out.data_ptr())
    lib.gated_rms_norm(*ptrs, rows, cols, eps, torch.get_num_threads())
    return out


def rotary_(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate `x` `[tokens, heads, head_dim]` in place (rotate_half layout; rows may be a view into
    a wider projection output) by cos, sin `[tokens, 1, head_dim // 2]`; False (x untouched) where
    the kernel does not apply."""
    if not takes(x, cos, sin):
        return False
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    lib.rotary_(
        x.data_ptr(), tokens, heads, x.stride(0), dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )
    return True


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:
    """`[rows, 2 * cols]` (gate, up side by side) -> `silu(gate) * up` as `[rows, cols]`; None where
    the kernel does not apply."""
    if not takes(x) or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        return None
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, cols, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, cols, torch.get_num_threads())
    return out


def gelu_tanh_(lib: ctypes.CDLL, x: torch.Tensor) -> bool:
    """transformers' tanh-GELU, in place on `x` (an MLP's hidden activations, which nothing else
    reads); False (x untouched) where the kernel does not apply."""
    if not takes(x) or not x.is_contiguous():
        return False
    lib.gelu_tanh_(x.data_ptr(), x.numel(), torch.get_num_threads())
    return True
