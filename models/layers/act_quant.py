"""The input quantization of compressed-tensors' W8A8 checkpoints (FP8 dynamic or static, int8
dynamic), as a fake quantization: the input rounded to int8 or fp8 at its scale and multiplied
back, then the same GEMM as any other low-bit layer.

The formulas are compressed-tensors' own (calculate_qparams and its quantize-dequantize), so that
a checkpoint computes what the library computes: per token, the scale is the row's largest
magnitude (0 included) over half the type's range (127.5 for int8: (127 - -128) / 2; 448 for
fp8), a zero scale becomes the dtype's eps; the input is divided by it (not multiplied by its
inverse), clamped to the type's range, rounded half to even (int8) or cast to e4m3 (fp8), and
multiplied by it again.
"""

from __future__ import annotations

import torch

RANGES = {"int8": (-128.0, 127.0), "fp8": (-448.0, 448.0)}


def fake_quantize(x: torch.Tensor, kind: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`x` at `kind`'s precision: per token (each row of the last dimension) when `scale` is
    None, else at that stored per-tensor scale."""
    low, high = (torch.tensor(v, dtype=x.dtype, device=x.device) for v in RANGES[kind])
    if scale is None:
        lowest, highest = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
        peak = torch.maximum(lowest.abs(), highest)
        scale = peak / ((high - low) / 2)
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    else:
        scale = scale.to(x.dtype)
    scaled = torch.clamp(x / scale, low, high)
    rounded = scaled.round() if kind == "int8" else scaled.to(torch.float8_e4m3fn).to(x.dtype)
    return rounded * scale
