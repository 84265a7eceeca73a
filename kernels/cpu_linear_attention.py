"""The gated delta rule's decode step in C (`cpu_linear_attention.c`), called via ctypes: one
token per sequence, the state updated in place in the state pool; and the causal conv in front of
it, its state updated in place alike. None where the kernel does not
apply (not float32 on CPU, an odd layout, a head wider than 512); the caller keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from mm_engine.kernels.cpu_build import takes

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
