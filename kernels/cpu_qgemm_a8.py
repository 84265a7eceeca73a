"""The integer GEMM with the input rounded to int8 per row (`cpu_qgemm_a8.c`: AVX-512 VNNI for
int8 and int4 weights, AVX2 for int4), called via ctypes.

`pack` lays a quantized weight out for it once, at load time (4 consecutive k of a column in one
32-bit lane, as `vpdpbusd` reads them); `qgemm_a8` quantizes the input as compressed-tensors does
(models/layers/act_quant.py) and runs it. `available` says whether this CPU and library have it;
elsewhere the layer fake-quantizes its input and runs the weight-only kernel, the same numbers up
to float rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from mm_engine.kernels.cpu_gemm import pack_panels
from mm_engine.kernels.cpu_qgemm import KINDS


@dataclass(frozen=True, slots=True)
class A8Panels:
    kind: str  # "int8" or "int4"
    weights: torch.Tensor  # the panels' bytes (int32 lanes of 4 bytes)
    scales: torch.Tensor  # float32 [panels, K / group, width]
    zeros: torch.Tensor | None  # int4: float32 like scales; None: 8
    wsum: torch.Tensor | None  # int8: int32 [panels, K / group, width], each group's column sum
    group: int
    n: int
    k: int


def available(lib: ctypes.CDLL | None, kind: str) -> bool:
    """Whether this library and CPU multiply `kind` weights by int8 inputs (avx512 with VNNI: int8
    and int4; avx2: int4)."""
    return lib is not None and kind in KINDS and bool(lib.qgemm_a8_kinds() >> KINDS[kind] & 1)


def fits(kind: str, k: int, group: int) -> bool:
    """Whether a weight can take this path: int8 or int4 whose groups are whole lanes of k."""
    step = 8 if kind == "int4" else 4
    return kind in ("int8", "int4") and k % group == 0 and group % step == 0


def pack(
    kind: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int, width: int
) -> A8Panels:
    """`q` `[N, K]`: int8, or int4 values 0..15 in uint8; `scales` and `zeros` `[N, K / group]`."""
    n, k = q.shape
    if kind == "int8":
        lanes = q.contiguous().view(torch.int8).view(n, k // 4, 4)
        wsum = q.to(torch.int32).view(n, k // group, group).sum(-1).to(torch.int32)
        wsum = pack_panels(wsum, width)
    else:  # byte j of lane i: k = 8i + j low, 8i + 4 + j high
        v = q.to(torch.uint8).view(n, k // 8, 2, 4)
        lanes = v[:, :, 0] | (v[:, :, 1] << 4)
        wsum = None
    words = lanes.contiguous().view(torch.int32).view(n, -1)  # one 32-bit lane a column and 4 k
    weights = pack_panels(words, width).view(torch.uint8)
    scales_p = pack_panels(scales.float(), width)
    zeros_p = None if zeros is None else pack_panels(zeros.float(), width)
    return A8Panels(kind, weights, scales_p, zeros_p, wsum, group, n, k)


def qgemm_a8(
    lib: ctypes.CDLL, rows: torch.Tensor, panels: A8Panels, scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`rows` `[M, K]` (float32, unit column stride) rounded to int8 (per row, or at the static
    per-tensor `scale`), times the packed weight, plus `bias` (padded to whole panels): `[M, N]`."""
    out = rows.new_empty((rows.shape[0], panels.n))
    if rows.shape[0]:
        static = None if scale is None else scale.float().reshape(1).contiguous()
        status = lib.qgemm_a8_panels(
            rows.data_ptr(), rows.stride(0), None if static is None else static.data_ptr(),
            panels.weights.data_ptr(), KINDS[panels.kind], panels.scales.data_ptr(),
            None if panels.zeros is None else panels.zeros.data_ptr(),
            None if panels.wsum is None else panels.wsum.data_ptr(), panels.group,
            None if bias is None else bias.data_ptr(), out.data_ptr(), panels.n, rows.shape[0], panels.n,
            panels.k, torch.get_num_threads(),
        )  # fmt: skip
        if status == -2:
            raise RuntimeError(f"the int8-input GEMM does not take {panels.kind} weights on this CPU")
        if status:
            raise MemoryError("the int8-input GEMM could not allocate its scratch")
    return out
