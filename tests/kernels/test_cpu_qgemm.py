"""The low-bit GEMM (kernels/cpu_qgemm.c) on every ISA variant this CPU runs, against the
dequantized weight through F.linear: each weight kind, the direct path (up to 16 rows, int4 on AVX2 8) and the
scratch-panel path, widths that end mid-panel, group sizes and per-row groups, bias, zero points;
and the quantizers' rounding against their definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mm_engine.models.layers.quant_linear import (
    QUANTIZATIONS,
    QuantizedWeight,
    QuantLinear,
    quantize,
    quantize_linears,
)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", QUANTIZATIONS)
@pytest.mark.parametrize(
    ("k", "n", "bias"), [(256, 100, True), (96, 48, False), (40, 7, True), (1000, 130, True), (90, 33, False)]
)
@torch.inference_mode()
def test_the_kernel_equals_the_dequantized_weight(cpu_lib, kind, k, n, bias):
    w = quantize(_weight(n, k, seed=k + n), kind)
    b = torch.randn(n) if bias else None
    fast, ref = QuantLinear(w, b, cpu_lib), QuantLinear(w, b)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    # Up to 16 rows (int4 on AVX2: 8) in the register tiles, 1-2 rows (K = 90: with a remainder)
    # over split sums; past 16: scratch panels.
    for rows in (1, 2, 3, 8, 9, 16, 17, 40):
        torch.testing.assert_close(fast(x[:rows]), ref(x[:rows]), rtol=1e-4, atol=1e-4 * k**0.5)
    assert fast(x[:0]).shape == (0, n)


@torch.inference_mode()
def test_int4_with_zero_points_and_a_strided_input(cpu_lib):
    n, k, group = 70, 256, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales, zeros = (
        torch.rand(n, k // group, generator=g) + 0.1,
        torch.randint(0, 16, (n, k // group), generator=g).float(),
    )
    w = QuantizedWeight("int4", q, scales, zeros, group)
    want = (q.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    torch.testing.assert_close(w.dequantize(), want)
    wide = torch.randn(12, k + 5, generator=g)
    x = wide[:, :k]  # rows with a stride wider than K
    for rows in (2, 6, 12, 20):  # grouped sums, scaled per weight, scratch panels
        torch.testing.assert_close(
            QuantLinear(w, None, cpu_lib)(x[:rows]), x[:rows] @ want.t(), rtol=1e-4, atol=1e-3
        )


@torch.inference_mode()
def test_int4_words_hold_eight_k_of_a_column(cpu_lib):
    """The int4 panels keep k = 8i + j in nibble j of word i: one weight set at a time lands on
    its own input and column. Off whole words (K or the group not a multiple of 8) the layer
    dequantizes instead, with the same result."""
    from mm_engine.kernels import cpu_qgemm

    n, k = 50, 64
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    for col, kk, value in ((0, 0, 15), (49, 63, 0), (17, 13, 3), (33, 40, 12)):
        q = torch.full((n, k), 8, dtype=torch.uint8)
        q[col, kk] = value
        w = QuantizedWeight("int4", q, torch.ones(n, 1), None, k)
        want = torch.zeros(1, n)
        want[0, col] = (value - 8) * x[0, kk]
        # (the tiles sum 16 + q and take 16 + zero times the sum of x back out: float32 noise)
        torch.testing.assert_close(QuantLinear(w, None, cpu_lib)(x), want, rtol=1e-5, atol=1e-4)
    assert cpu_qgemm.fits("int4", 64, 32) and not cpu_qgemm.fits("int4", 60, 20)
    assert not cpu_qgemm.fits("int4", 48, 12) and cpu_qgemm.fits("int8", 10, 10)
    w = quantize(_weight(9, 36, seed=2), "int4", 12)
    layer = QuantLinear(w, None, cpu_lib)
    assert layer.panels is None
    x = torch.randn(3, 36, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x), x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_the_quantizers_round_to_their_grids():
    w = _weight(6, 256, seed=0)
    for kind, levels in (("int8", 127), ("int4", 7)):
        qw = quantize(w, kind)
        assert qw.group == 128 and qw.scales.shape == (6, 2)
        step = qw.scales.repeat_interleave(128, 1)
        assert (qw.dequantize() - w).abs().le(step / 2 + 1e-6).all()  # within half a step
        assert qw.dequantize().abs().amax() <= w.abs().amax() + 1e-5  # the largest hits +-levels
        assert qw.q.float().sub(8 if kind == "int4" else 0).abs().max() == levels
    fp8 = quantize(w, "fp8")
    torch.testing.assert_close(fp8.dequantize(), w, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits
    assert quantize(_weight(3, 96, 1), "int8").group == 32 and quantize(_weight(3, 40, 1), "int8").group == 40
    assert quantize(w, "bf16").q.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize(w, "int3")


def test_quantize_linears_leaves_the_head_alone():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 32)])
    model.lm_head = nn.Linear(64, 100)
    assert quantize_linears(model, "int8", None) == 2
    assert all(isinstance(m, QuantLinear) for m in model.layers) and isinstance(model.lm_head, nn.Linear)
    x = torch.randn(3, 64)
    ref = F.linear(x, model.layers[0].weight_q.dequantize(), model.layers[0].bias)
    torch.testing.assert_close(model.layers[0](x), ref)
