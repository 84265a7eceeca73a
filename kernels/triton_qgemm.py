"""The low-bit GEMM in Triton (the CUDA path of models/layers/quant_linear.py): y = x W^T + b with
W as `QuantizedWeight` keeps it, row by row: bf16, fp8 (e4m3), int8, or int4 two to a byte (k even
in the low nibble), a float scale per output row and group of K (and int4 zero points). Each
program computes a BLOCK_M x BLOCK_N tile of y, converting each BLOCK_K x BLOCK_N tile of W to
the activations' dtype in registers (W4A16 / W8A16: the weights are never dequantized in memory).
int4 is read a byte at a time: the even and odd k of a tile are two half-width dot products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KINDS = {"bf16": 0, "fp8": 1, "int8": 2, "int4": 3}


@triton.jit
def _scaled(
    q, scales, zeros, cols, n_groups, k_index, group, mask, KIND: tl.constexpr, HAS_ZEROS: tl.constexpr
):
    """A [K, N] tile of stored values (their bits: bf16 as int16, fp8 as uint8) as float32 weights."""
    if KIND == 0:  # bf16: the high half of a float32
        w = ((q.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif KIND == 1:  # e4m3: exponent and mantissa moved to float32's places, then rescaled (cpu_qgemm.c)
        bits = q.to(tl.int32)
        w = ((bits & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        w = tl.where((bits & 0x80) != 0, -w, w)
    else:
        w = q.to(tl.float32)
    if KIND == 3:
        w = w - 8.0
    if KIND != 0:
        g = k_index // group
        s = tl.load(scales + cols[None, :] * n_groups + g[:, None], mask=mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(zeros + cols[None, :] * n_groups + g[:, None], mask=mask, other=8.0)
            w = w - (z - 8.0)
        w = w * s
    return w


@triton.jit
def _qgemm_kernel(
    x, q, scales, zeros, bias, y, M, N, K, group,
    stride_xm, stride_qn, stride_ym,
    KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    n_groups = tl.cdiv(K, group)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if KIND == 3:  # int4: BLOCK_K bytes hold 2 x BLOCK_K weights, k even low, k odd high
        for b0 in range(0, tl.cdiv(K, 2), BLOCK_K):
            bs = b0 + tl.arange(0, BLOCK_K)
            b_ok = bs < tl.cdiv(K, 2)
            mask = b_ok[:, None] & col_ok[None, :]
            raw = tl.load(q + cols[None, :] * stride_qn + bs[:, None], mask=mask, other=0).to(tl.int32)
            for half in tl.static_range(2):
                ks = 2 * bs + half
                k_ok = ks < K
                nib = (raw >> (4 * half)) & 15
                w = _scaled(
                    nib, scales, zeros, cols, n_groups, ks, group, mask & k_ok[:, None], KIND, HAS_ZEROS
                )
                a = tl.load(
                    x + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    else:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            mask = k_ok[:, None] & col_ok[None, :]
            stored = tl.load(q + cols[None, :] * stride_qn + ks[:, None], mask=mask, other=0)
            w = _scaled(stored, scales, zeros, cols, n_groups, ks, group, mask, KIND, HAS_ZEROS)
            a = tl.load(
                x + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def qgemm(
    x: torch.Tensor, kind: str, q: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
    group: int, bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`x` `[M, K]` (unit column stride) times the weight `q` `[N, K]` (int4: `[N, K / 2]` packed),
    `scales` and `zeros` `[N, K / group]` float32, plus `bias`: `[M, N]` in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    q = {"bf16": lambda t: t.view(torch.int16), "fp8": lambda t: t.view(torch.uint8)}.get(kind, lambda t: t)(
        q
    )
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    dummy = x.new_zeros(1, dtype=torch.float32)
    _qgemm_kernel[grid](
        x, q, scales if scales is not None else dummy, zeros if zeros is not None else dummy,
        bias if bias is not None else dummy, y, m, n, k, group,
        x.stride(0), q.stride(0), y.stride(0),
        KINDS[kind], zeros is not None, bias is not None, block_m, block_n, block_k,
        "ieee" if x.dtype == torch.float32 else None,
    )  # fmt: skip
    return y
