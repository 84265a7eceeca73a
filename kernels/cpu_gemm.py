"""The C GEMM (`cpu_gemm.c`) for the language model's linear layers, called via ctypes.

A decode step multiplies a few to 64 rows by every weight of the model, so on CPU the step is a
stream of weights from memory, and the GEMM's speed is how close it reads them to the machine's
copy bandwidth; oneDNN's packed sgemm (which the vision tower keeps) stays well short of it at a
few rows (docs/cpu.md has the figures). At prefill sizes the two are even. Results differ from
oneDNN's and MKL's in summation order only, as any two GEMMs do.

`pack_panels` packs a weight once, for the panel width of the library's variant; `gemm` runs
y = x W^T + b on the packed panels. mm_engine.models.layers.packed_linear wraps them as a module.
"""

from __future__ import annotations

import ctypes

import torch


def panel_width(lib: ctypes.CDLL) -> int:
    """Output columns per packed panel in this variant (48 on AVX-512, 16 on AVX2, 8 portable)."""
    return lib.gemm_panel_width()


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """`[N, K]` -> `[ceil(N / width), K, width]`: `width` output columns per panel, zero columns
    past N."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // width) * width, k)
    padded[:n] = weight
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


def padded_bias(bias: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """A bias in float32 with zeros up to whole panels (what the GEMMs add per panel)."""
    if bias is None:
        return None
    out = bias.new_zeros(-(-bias.shape[0] // width) * width, dtype=torch.float32)
    out[: bias.shape[0]] = bias.detach()
    return out


def gemm(
    lib: ctypes.CDLL, rows: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """`rows` `[M, K]` (float32, unit column stride, any row stride) times the packed weight, plus
    `bias` (padded to whole panels, or None): `[M, n]`, contiguous."""
    out = rows.new_empty((rows.shape[0], n))
    if rows.shape[0]:
        lib.gemm_panels(
            rows.data_ptr(),
            rows.stride(0),
            panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            rows.shape[0],
            n,
            rows.shape[1],
            torch.get_num_threads(),
        )
    return out
