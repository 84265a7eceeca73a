"""The C GEMM (`cpu_gemm.c`) for the language model's linear layers, called via ctypes.

A decode step multiplies a few to 64 rows by every weight of the model, so on CPU the step is a
stream of weights from memory. oneDNN's packed sgemm (which the vision tower keeps) read them at
about half the machine's copy bandwidth at 1-8 rows and ran 64 rows at about 75% of its matmul
rate. On the benchmark model's decoder (30 layers of q/k/v, o, gate/up
and down projections, 2 threads of the 2-core AVX-512 development machine, the avx512
variant), best of 5:

    rows              1        8        16       32       48       64       2048
    oneDNN            19 ms    22-26    26-30    42-52    69-72    76-83    219-220 GFLOP/s
    cpu_gemm.c        10.5-11  12.5-15  19-20    36-42    58-59    70-77    208-215 GFLOP/s

(rows 1-64 in ms per pass over the 30 layers). At one row that is 425 MB of weights at 40 GB/s.
At 2048 rows (prefill) the two are within a few percent, either way round from run to run; inside
a caption job they took the same time. Results differ from oneDNN's and MKL's in summation order
only (about 1e-4 absolute on unit-scale activations), as any two GEMMs do.

`pack_panels` packs a weight once, for the panel width of the library's variant; `gemm` runs
y = x W^T + b on the packed panels. mm_engine.packed_linear wraps them as a module.
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
