"""Fused activations in C (`cpu_elementwise.c`) for the CPU path, called via ctypes: SiLU-and-
multiply for the decoder MLPs and an in-place tanh-GELU for a SigLIP vision tower's MLPs.

`use_fused_activations(model)` switches a loaded model over (the engine does it for the "cpu"
backend); every call still falls back to torch where the kernel does not apply (not built, not
float32 on CPU, an odd layout).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import GELUTanh, SiLUActivation

from mm_engine.kernels import cpu_build


def _applies(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`[rows, 2 * cols]` (gate, up side by side) -> `silu(gate) * up` as `[rows, cols]`; None where
    the kernel does not apply."""
    lib = cpu_build.load()
    if lib is None or not _applies(x) or x.shape[1] % 2:
        return None
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, cols, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), rows, cols, torch.get_num_threads())
    return out


class InplaceGeluTanh(nn.Module):
    """transformers' tanh-GELU, computed in place on its input where the kernel applies: for an
    MLP's hidden activations, which nothing else reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = cpu_build.load()
        if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
            return nn.functional.gelu(x, approximate="tanh")
        lib.gelu_tanh_(x.data_ptr(), x.numel(), torch.get_num_threads())
        return x


def use_fused_activations(model: nn.Module) -> int:
    """Route the decoder MLPs' SiLU-and-multiply and the vision MLPs' tanh-GELU through the C
    kernels; returns how many MLPs were switched (none when the kernels cannot be built)."""
    if cpu_build.load() is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "act", None), SiLUActivation) and hasattr(module, "act_and_mul"):
            module.act_and_mul = silu_and_mul  # mm_engine.layers.MLP
            count += 1
        elif isinstance(getattr(module, "activation_fn", None), GELUTanh) and hasattr(module, "fc2"):
            module.activation_fn = InplaceGeluTanh()  # a CLIP/SigLIP-style MLP: fc1 -> act -> fc2
            count += 1
    return count
