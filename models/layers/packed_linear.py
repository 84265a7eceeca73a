"""CPU linear layers with weights packed once at load time: through oneDNN (`PackedLinear`), or
through the C GEMM of one ISA variant (`PanelLinear`, kernels/cpu_gemm.py).

PyTorch's `nn.Linear` on CPU calls MKL's sgemm, which re-packs the weight on every call and runs the
few-row GEMMs of a decode step well below the machine's matmul rate. oneDNN with a weight
reordered once into its blocked layout (the same ops inductor's freezing pass emits) does not
(docs/cpu.md has the figures). Results differ from MKL's only in summation order, as any two GEMM
libraries do.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from mm_engine.kernels import cpu_gemm

# The row count oneDNN tunes the packed layout for. Any row count works; 64 (a decode batch) was
# within a few percent of the best for 1-2048 rows in the measurement above.
BATCH_HINT = 64


def can_pack(linear: nn.Linear) -> bool:
    w = linear.weight
    on_cpu = w.device.type == "cpu" and torch.backends.mkldnn.is_available()
    dtype_ok = w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and onednn_bf16())
    return on_cpu and dtype_ok and _have_ops()


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN can reorder and multiply bf16 weights here: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses otherwise (an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA below them).
    Asked of oneDNN itself, with one tiny reorder."""
    if not (torch.backends.mkldnn.is_available() and _have_ops()):
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w = torch.zeros(8, 8, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(2, 8, dtype=torch.bfloat16), packed, None, "none", [], ""
        )
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _have_ops() -> bool:
    """The two ops are the ones inductor's CPU freezing pass emits, not public API: a torch build
    without them keeps plain `nn.Linear` instead of failing at load."""
    try:
        return all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """`nn.Linear` for inference with its weight in oneDNN's packed layout. The packed copy is an
    opaque tensor, so it is a plain attribute, not a parameter: nothing trains or saves it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class PanelLinear(nn.Module):
    """`nn.Linear` for inference with its weight packed in panels for one variant's C GEMM. The
    panels are a plain attribute, not a parameter: nothing trains or saves them."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        if not float32_on_cpu(linear):
            w = linear.weight
            raise TypeError(f"PanelLinear packs float32 CPU weights, got {w.dtype} on {w.device}")
        self.in_features, self.out_features, self.lib = linear.in_features, linear.out_features, lib
        width = cpu_gemm.panel_width(lib)
        with torch.no_grad():
            self.panels = cpu_gemm.pack_panels(linear.weight.detach(), width)
            self.bias = cpu_gemm.padded_bias(linear.bias, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"PanelLinear takes float32 CPU input, got {x.dtype} on {x.device}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = cpu_gemm.gemm(self.lib, rows, self.panels, self.bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def float32_on_cpu(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"


def panel_linears(module: nn.Module, lib: ctypes.CDLL) -> int:
    """Replace every float32 CPU `nn.Linear` under `module` with a `PanelLinear` on `lib`'s GEMM;
    returns how many."""
    return swap_linears(module, float32_on_cpu, lambda linear: PanelLinear(linear, lib))


def pack_linears(module: nn.Module) -> int:
    """Replace every packable `nn.Linear` under `module` with a `PackedLinear`; returns how many."""
    return swap_linears(module, can_pack, PackedLinear)


def swap_linears(module: nn.Module, accept, wrap) -> int:
    """Replace every `nn.Linear` under `module` that `accept(linear)` takes with `wrap(linear)`;
    returns how many. A weight tied to another module (an LM head tied to the embeddings) is
    copied by the wrapper, not moved."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and accept(child):
            setattr(module, name, wrap(child))
            count += 1
        else:
            count += swap_linears(child, accept, wrap)
    return count
