"""The gated delta rule's decode step in C (`cpu_linear_attention.c`), called via ctypes: one
token per sequence, the state updated in place in the state pool; the causal conv in front of it,
its state updated in place alike; and a whole linear-attention decode (conv, gates, delta rule,
gated norm) in one call. None where the kernel does not apply (not float32 on CPU, an odd layout, a
head wider than 512); the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from mm_engine.kernels.cpu_build import takes
from mm_engine.kernels.gated_delta import DeltaWeights

MAX_DIM = 512


def delta_rule_step_(
    lib: ctypes.CDLL, state: torch.Tensor, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, key_heads: int,
) -> torch.Tensor | None:  # fmt: skip
    """`state` `[rows, heads, key_dim, value_dim]` (the pool), `slots` `[batch]` its rows, `qkv`
    `[batch, q | k | v]` (after the conv), g and beta `[batch, heads]`. Returns `[batch, heads,
    value_dim]`."""
    rows, heads, dk, dv = state.shape
    batch = qkv.shape[0]
    if not (takes(state, qkv, g, beta) and state.is_contiguous() and qkv.stride(1) == 1):
        return None
    if max(dk, dv) > MAX_DIM or heads % key_heads or qkv.shape[1] != 2 * key_heads * dk + heads * dv:
        return None
    slots = slots.to(torch.int64).contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(batch, heads, dv)
    lib.delta_rule_step_(
        state.data_ptr(), slots.data_ptr(), qkv.data_ptr(), qkv.stride(0), g.data_ptr(), beta.data_ptr(),
        out.data_ptr(), batch, heads, key_heads, dk, dv, torch.get_num_threads(),
    )  # fmt: skip
    return out


def conv_step_(
    lib: ctypes.CDLL, conv: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor | None:
    """`conv` `[rows, channels, width - 1]` (the pool), `slots` `[batch]` its rows, `x` `[batch,
    channels]` (rows may be a view into a wider projection), `weight` `[channels, width]`. Returns
    SiLU of the conv `[batch, channels]`; None where the kernel does not apply."""
    channels, keep = conv.shape[1:]
    if not (takes(conv, x, weight) and conv.is_contiguous() and weight.is_contiguous() and x.stride(1) == 1):
        return None
    if weight.shape != (channels, keep + 1) or x.shape[1] != channels:
        return None
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(x.shape[0], channels)
    lib.conv_step_(
        conv.data_ptr(), slots.data_ptr(), x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
        x.shape[0], channels, keep + 1, torch.get_num_threads(),
    )  # fmt: skip
    return out


def gated_delta_decode_(
    lib: ctypes.CDLL, conv: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, mixed: torch.Tensor,
    z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w: DeltaWeights,
) -> torch.Tensor | None:  # fmt: skip
    """TorchOps.gated_delta_decode_'s contract in one C call; None where it does not apply (b and a
    must share their row stride, as views into one projection or two `[batch, heads]` tensors)."""
    rows, heads, dk, dv = state.shape
    batch, width = mixed.shape[0], w.conv.shape[1]
    if not (takes(conv, state, mixed, z, b, a, w.conv, w.a_log, w.dt_bias, w.norm) and state.is_contiguous()):
        return None
    if not (conv.is_contiguous() and w.conv.is_contiguous() and w.norm.is_contiguous()):
        return None
    if any(t.stride(1) != 1 for t in (mixed, z, b, a)) or b.stride(0) != a.stride(0):
        return None
    if max(dk, dv) > MAX_DIM or heads % w.key_heads or conv.shape[1:] != (mixed.shape[1], width - 1):
        return None
    if mixed.shape[1] != 2 * w.key_heads * dk + heads * dv or z.shape[1] != heads * dv:
        return None
    slots = slots.to(torch.int64).contiguous()
    a_log, dt_bias = w.a_log.contiguous(), w.dt_bias.contiguous()
    out = torch.empty(batch, heads * dv)
    failed = lib.gated_delta_decode_(
        conv.data_ptr(), state.data_ptr(), slots.data_ptr(), mixed.data_ptr(), mixed.stride(0), z.data_ptr(),
        z.stride(0), b.data_ptr(), a.data_ptr(), b.stride(0), w.conv.data_ptr(), a_log.data_ptr(),
        dt_bias.data_ptr(), w.norm.data_ptr(), w.eps, out.data_ptr(), batch, heads, w.key_heads, dk, dv,
        width, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the linear-attention decode could not allocate its scratch")
    return out
