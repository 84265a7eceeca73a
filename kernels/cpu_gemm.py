"""The language model's linear layers through the C GEMM (`cpu_gemm.c`), called via ctypes.

A decode step multiplies a few to 64 rows by every weight of the model, so on CPU the step is a
stream of weights from memory. oneDNN's packed sgemm (mm_engine.packed_linear, which the vision
tower keeps) read them at about half the machine's copy bandwidth at 1-8 rows and ran 64 rows at
about 75% of its matmul rate. On the benchmark model's decoder (30 layers of q/k/v, o, gate/up
and down projections, 2 threads of the 2-core AVX-512 development machine), best of 5:

    rows              1        8        16       32       48       64       2048
    oneDNN            19 ms    22-26    26-30    42-52    69-72    76-83    219-220 GFLOP/s
    cpu_gemm.c        10.5-11  12.5-15  19-20    36-42    58-59    70-77    208-215 GFLOP/s

(rows 1-64 in ms per pass over the 30 layers). At one row that is 425 MB of weights at 40 GB/s.
At 2048 rows (prefill) the two are within a few percent, either way round from run to run; inside
a caption job they took the same time. Results differ from oneDNN's and MKL's in summation order
only (about 1e-4 absolute on unit-scale activations), as any two GEMMs do.

`use_for(module)` swaps a float32 CPU module's `nn.Linear`s for `PanelLinear`s (the engine does
it for the language model on the "cpu" backend); nothing changes where the kernels do not build.
"""

from __future__ import annotations

import torch
from torch import nn

from mm_engine.kernels import cpu_build

PANEL = 48  # output columns per packed panel (NR in cpu_gemm.c)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` -> `[ceil(N / 48), K, 48]`: 48 output columns per panel, zero columns past N."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


class PanelLinear(nn.Module):
    """`nn.Linear` for inference with its weight packed in panels for `cpu_gemm.c`. The panels are
    a plain attribute, not a parameter: nothing trains or saves them."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not _float32_on_cpu(linear):
            w = linear.weight
            raise TypeError(f"PanelLinear packs float32 CPU weights, got {w.dtype} on {w.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.panels = pack_panels(linear.weight.detach())
            self.bias = None
            if linear.bias is not None:
                self.bias = linear.bias.detach().new_zeros(self.panels.shape[0] * PANEL)
                self.bias[: self.out_features] = linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"PanelLinear takes float32 CPU input, got {x.dtype} on {x.device}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = rows.new_empty((rows.shape[0], self.out_features))
        if rows.shape[0]:
            cpu_build.load().gemm_panels(
                rows.data_ptr(),
                rows.stride(0),
                self.panels.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(),
                out.data_ptr(),
                self.out_features,
                rows.shape[0],
                self.out_features,
                self.in_features,
                torch.get_num_threads(),
            )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def _float32_on_cpu(linear: nn.Linear) -> bool:
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"


def use_for(module: nn.Module) -> int:
    """Replace every float32 CPU `nn.Linear` under `module` with a `PanelLinear`; returns how many
    (none when the kernels cannot be built). A weight tied to another module (an LM head tied to
    the embeddings) is copied, not moved."""
    from mm_engine.packed_linear import swap_linears  # not at import: mm_engine imports this package

    if cpu_build.load() is None:
        return 0
    return swap_linears(module, _float32_on_cpu, PanelLinear)
