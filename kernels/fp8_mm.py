"""FP8 x FP8 matrix products through `torch._scaled_mm`, for layers whose checkpoint quantizes
both sides to e4m3 (compressed-tensors' FP8 schemes): the weight with one scale per output row
(per channel or per tensor), the input per token (dynamic) or at a stored per-tensor scale.

The input is rounded exactly as act_quant.fake_quantize rounds it, so the product is the
reference's (the dequantized weight times the fake-quantized input) up to float32 summation
order; the matrix units then read fp8 on both sides instead of a weight converted to 16 bits.
On CUDA this needs compute capability 8.9 or newer (Ada, Hopper); elsewhere the layer keeps its
other paths. A weight scaled per group of inputs (block FP8) stays on the Triton kernel.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # e4m3's largest finite value


def device_supports(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` multiplies e4m3 by e4m3 on `device`."""
    if device.type != "cuda":
        return device.type == "cpu"  # PyTorch's CPU implementation (row-wise and per tensor)
    return torch.cuda.get_device_capability(device) >= (8, 9)


def applies(kind: str, act: str | None, group: int, n: int, k: int) -> bool:
    """Whether a weight `[n, k]` of `kind` with this input quantization and group can take the
    FP8 product: both sides e4m3, one weight scale per row, and sizes the matrix units accept
    (multiples of 16)."""
    return kind == "fp8" and act == "fp8" and group == k and n % 16 == 0 and k % 16 == 0


def takes(x: torch.Tensor) -> bool:
    """Whether to take `x` this way: on CUDA only a 16-bit input, since row-wise scaling writes
    bfloat16 there (a float32 run, the engine's GPU tests, keeps its precision on the Triton
    kernel)."""
    return x.device.type != "cuda" or x.dtype != torch.float32


def input_scales(x: torch.Tensor, static: torch.Tensor | None) -> torch.Tensor:
    """The input's scale per row `[M, 1]` in x's dtype, computed as act_quant.fake_quantize does:
    the row's largest magnitude over 448 (a zero row: the dtype's eps), or the stored
    per-tensor scale on every row."""
    if static is not None:
        return static.to(x.dtype).reshape(1, 1).expand(x.shape[0], 1)
    peak = x.abs().amax(-1, keepdim=True)
    scale = peak / torch.tensor(FP8_MAX, dtype=x.dtype, device=x.device)
    return torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor, static: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """`x` `[M, K]` times the e4m3 weight `q` `[N, K]` (scales `[N, 1]`), plus `bias`: `[M, N]`
    in x's dtype. Row-wise scaling writes bfloat16 on CUDA (the only output it supports there)."""
    scale = input_scales(x, static)
    xq = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale_a = scale.float().contiguous()
    scale_b = row_scales.float().reshape(1, -1).contiguous()
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else torch.float32
    y = torch._scaled_mm(xq, q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    y = y.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)
