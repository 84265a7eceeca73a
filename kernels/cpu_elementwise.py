"""Fused elementwise passes in C (`cpu_elementwise.c`) for the CPU path, called via ctypes:
SiLU-and-multiply for the decoder MLPs, an in-place tanh-GELU for a SigLIP vision tower's MLPs,
RMSNorm with the residual add folded in, and rotary embedding in place.

`use_c_kernels(model)` switches a loaded model over (the engine does it for the "cpu" backend);
every call still falls back to torch where the kernel does not apply (not built, not float32 on
CPU, an odd layout).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import GELUTanh, SiLUActivation

from mm_engine.kernels import cpu_build


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(x, rms_norm(x) * weight)` over the last dim, with delta first added to x in place (the
    residual stream, which only the forward pass holds); None where the kernel does not apply,
    and then x is untouched."""
    tensors = (x, weight) if delta is None else (x, weight, delta)
    lib = cpu_build.lib_for(*tensors)
    if lib is None or not all(t.is_contiguous() for t in tensors):
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


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate `x` `[tokens, heads, head_dim]` in place (rotate_half layout; rows may be a view into
    a wider projection output) by cos, sin `[tokens, 1, head_dim // 2]`; False (x untouched) where
    the kernel does not apply."""
    lib = cpu_build.lib_for(x, cos, sin)
    if lib is None:
        return False
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    lib.rotary_(
        x.data_ptr(), tokens, heads, x.stride(0), dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`[rows, 2 * cols]` (gate, up side by side) -> `silu(gate) * up` as `[rows, cols]`; None where
    the kernel does not apply."""
    lib = cpu_build.lib_for(x)
    if lib is None or x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        return None
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, cols, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, cols, torch.get_num_threads())
    return out


class InplaceGeluTanh(nn.Module):
    """transformers' tanh-GELU, computed in place on its input where the kernel applies: for an
    MLP's hidden activations, which nothing else reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = cpu_build.lib_for(x)
        if lib is None or not x.is_contiguous():
            return nn.functional.gelu(x, approximate="tanh")
        lib.gelu_tanh_(x.data_ptr(), x.numel(), torch.get_num_threads())
        return x


def use_c_kernels(model: nn.Module) -> int:
    """Route the decoder's norms, rotary and SiLU-and-multiply and the vision MLPs' tanh-GELU
    through the C kernels; returns how many modules were switched (none when the kernels cannot be
    built)."""
    from mm_engine.layers import Attention, RMSNorm

    if cpu_build.load() is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention)):
            module.c_kernels = True
            count += 1
        elif isinstance(getattr(module, "act", None), SiLUActivation) and hasattr(module, "act_and_mul"):
            module.act_and_mul = silu_and_mul  # mm_engine.layers.MLP
            count += 1
        elif isinstance(getattr(module, "activation_fn", None), GELUTanh) and hasattr(module, "fc2"):
            module.activation_fn = InplaceGeluTanh()  # a CLIP/SigLIP-style MLP: fc1 -> act -> fc2
            count += 1
    return count
