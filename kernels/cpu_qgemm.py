"""The low-bit GEMM (`cpu_qgemm.c`): y = x W^T + b with W in bf16, fp8 (e4m3), int8 or packed
unsigned int4, a float scale (and zero point) per output column and group of K, called via ctypes.

`pack` lays a quantized weight out in the float GEMM's panels (cpu_gemm.py: the same width) once,
at load time; `qgemm` runs it.
Both take the plain per-row form models/layers/quant_linear.py keeps: `q` `[N, K]` (the stored
values, int4 as 0..15 in uint8), `scales` and `zeros` `[N, K / group]`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from mm_engine.kernels.cpu_gemm import pack_panels

KINDS = {"bf16": 1, "fp8": 2, "int8": 3, "int4": 4}


@dataclass(frozen=True, slots=True)
class QPanels:
    kind: str
    weights: torch.Tensor  # uint8, the panels' bytes
    scales: torch.Tensor | None  # float32 [panels, K / group, width]
    zeros: torch.Tensor | None
    group: int
    n: int
    k: int


def int4_bytes(q: torch.Tensor) -> torch.Tensor:
    """int4 values 0..15 `[N, K]` (uint8) two to a byte, `[N, K / 2]`: k even in the low nibble
    (the layout both low-bit GEMMs read, and compressed-tensors' 4-bit packing in bytes)."""
    return (q[:, 0::2].to(torch.uint8) | (q[:, 1::2].to(torch.uint8) << 4)).contiguous()


def fits(kind: str, k: int, group: int) -> bool:
    """Whether the kernel takes this weight: int4 reads eight k a word, within one group."""
    return kind != "int4" or (k % 8 == 0 and group % 8 == 0)


def pack(
    kind: str,
    q: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    group: int,
    width: int,
) -> QPanels:
    """`q` `[N, K]`: bf16 or float8_e4m3fn values, int8, or int4 values 0..15 in uint8 (K and
    the group a multiple of 8)."""
    n, k = q.shape
    if zeros is not None and kind != "int4":
        raise ValueError(f"zero points are for int4 weights only, got them with {kind}")
    if kind == "int4":
        if not fits(kind, k, group):
            raise ValueError(f"int4 panels need K and the group a multiple of 8, got K={k}, group={group}")
        # eight k of a column in one 32-bit word (the bytes' little-endian order): [panels, K / 8, width]
        weights = pack_panels(int4_bytes(q).view(torch.int32), width).view(torch.uint8)
    elif kind == "bf16":  # each weight's two bytes together: [panels, K, width] of 16 bits
        weights = pack_panels(q.contiguous().view(torch.int16), width).view(torch.uint8)
    else:
        weights = pack_panels(q.contiguous().view(torch.uint8), width)
    scales, zeros = (None if t is None else pack_panels(t.float(), width) for t in (scales, zeros))
    return QPanels(kind, weights, scales, zeros, group, n, k)


def qgemm(lib: ctypes.CDLL, rows: torch.Tensor, panels: QPanels, bias: torch.Tensor | None) -> torch.Tensor:
    """`rows` `[M, K]` (float32, unit column stride) times the packed weight, plus `bias` (padded
    to whole panels, or None): `[M, N]`, contiguous."""
    out = rows.new_empty((rows.shape[0], panels.n))
    if rows.shape[0]:
        status = lib.qgemm_panels(
            rows.data_ptr(),
            rows.stride(0),
            panels.weights.data_ptr(),
            KINDS[panels.kind],
            None if panels.scales is None else panels.scales.data_ptr(),
            None if panels.zeros is None else panels.zeros.data_ptr(),
            panels.group,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            panels.n,
            rows.shape[0],
            panels.n,
            panels.k,
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("the low-bit GEMM could not allocate its scratch panel")
    return out
