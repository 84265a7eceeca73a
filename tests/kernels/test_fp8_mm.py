"""The FP8 x FP8 product (kernels/fp8_mm.py): `torch._scaled_mm` with the input rounded per token
or at a stored scale equals the reference (act_quant's fake quantization, then the dequantized
weight through F.linear), on CPU in float32 here and compiled on a GPU with
MM_ENGINE_TEST_DEVICE=cuda (float16 in, bfloat16 out: a looser bound); and `QuantLinear` on the
Triton path takes it exactly where both sides are FP8 with a scale per weight row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.device import TEST_DEVICE
from mm_engine.kernels import fp8_mm
from mm_engine.models.layers.act_quant import fake_quantize
from mm_engine.models.layers.quant_linear import QuantizedWeight, QuantLinear, quantize

DTYPE = torch.float16 if TEST_DEVICE.type == "cuda" else torch.float32
# On CUDA the product is written in bfloat16 (8 bits of mantissa), then as float16.
TOL = dict(rtol=1e-2, atol=5e-2) if TEST_DEVICE.type == "cuda" else dict(rtol=1e-5, atol=1e-5)


def _fp8_weight(n: int, k: int, seed: int, static: bool = False) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g), "fp8", group=k)  # one scale per row
    w.act = "fp8"
    w.act_scale = torch.tensor(0.02) if static else None
    return w.to(TEST_DEVICE)


def _reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's reference path: the input rounded in its own dtype (the scale too), then a
    float32 product with the dequantized weight."""
    x = fake_quantize(x, "fp8", w.act_scale).float().cpu()
    return F.linear(x, w.dequantize().cpu(), None if bias is None else bias.float().cpu())


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize(("n", "k", "rows"), [(32, 64, 1), (48, 128, 7), (128, 256, 33)])
def test_the_fp8_product_equals_the_fake_quantized_reference(n, k, rows, static):
    w = _fp8_weight(n, k, n + k, static)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=g) * 3).to(TEST_DEVICE, DTYPE)
    bias = torch.randn(n, generator=g).to(TEST_DEVICE)
    got = fp8_mm.fp8_linear(x, w.q, w.scales, w.act_scale, bias)
    assert got.dtype == DTYPE and got.shape == (rows, n)
    torch.testing.assert_close(got.float().cpu(), _reference(x, w, bias), **TOL)


def test_a_zero_row_gives_the_bias():
    w = _fp8_weight(16, 32, 1)
    x = torch.zeros(2, 32, device=TEST_DEVICE, dtype=DTYPE)
    x[1] = 1.0
    bias = torch.arange(16.0, device=TEST_DEVICE)
    got = fp8_mm.fp8_linear(x, w.q, w.scales, None, bias)
    assert torch.equal(got[0].float().cpu(), bias.cpu())
    torch.testing.assert_close(got.float().cpu(), _reference(x, w, bias), **TOL)


def test_quant_linear_takes_the_fp8_product_only_where_it_applies():
    both = _fp8_weight(64, 128, 2)
    layer = QuantLinear(both, None, triton=True)
    assert layer.fp8 and "fp8 scaled_mm" in repr(layer)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(4)).to(TEST_DEVICE, DTYPE)
    torch.testing.assert_close(layer(x).float().cpu(), _reference(x, both, None).view(3, 5, 64), **TOL)
    weight_only = quantize(torch.randn(64, 128), "fp8", group=128).to(TEST_DEVICE)
    blocks = _fp8_weight(64, 128, 3)
    blocks.scales, blocks.group = blocks.scales.repeat(1, 2), 64  # two groups of K: a block layout
    odd = _fp8_weight(40, 128, 5)  # 40 outputs: not a multiple of 16
    for w in (weight_only, blocks, odd):
        assert not QuantLinear(w, None, triton=True).fp8
    assert not QuantLinear(both, None).fp8  # the dequantizing reference path stays the reference


def test_the_conditions():
    assert fp8_mm.applies("fp8", "fp8", 128, 64, 128)
    assert not fp8_mm.applies("fp8", None, 128, 64, 128)
    assert not fp8_mm.applies("int8", "int8", 128, 64, 128)
    assert not fp8_mm.applies("fp8", "fp8", 64, 64, 128)
    assert not fp8_mm.applies("fp8", "fp8", 120, 64, 120)
    assert fp8_mm.device_supports(torch.device("cpu"))
