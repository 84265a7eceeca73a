"""The Triton low-bit GEMM (kernels/triton_qgemm.py), run by the Triton interpreter on CPU
tensors (or compiled on a GPU with MM_ENGINE_TEST_DEVICE=cuda), against the dequantized weight
through F.linear: each weight kind, row counts across its tiles, widths and K that end mid-tile,
per-row groups, bias, int4 zero points; and `QuantLinear` on the Triton path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.device import TEST_DEVICE
from mm_engine.config import WEIGHT_KINDS
from mm_engine.kernels.cpu_qgemm import int4_bytes
from mm_engine.kernels.triton_qgemm import qgemm
from mm_engine.models.layers.quant_linear import QuantizedWeight, QuantLinear, quantize


def _on(*xs):
    return [None if x is None else x.to(TEST_DEVICE) for x in xs]


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize(("n", "k", "rows"), [(40, 64, 3), (100, 256, 17), (70, 96, 1)])
def test_the_kernel_equals_the_dequantized_weight(kind, n, k, rows):
    g = torch.Generator().manual_seed(n + k)
    w = quantize(torch.randn(n, k, generator=g), kind)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    q = int4_bytes(w.q) if kind == "int4" else w.q
    got = qgemm(*_on(x), kind, *_on(q, w.scales, w.zeros), w.group, *_on(b))
    torch.testing.assert_close(got.cpu(), F.linear(x, w.dequantize(), b), rtol=1e-4, atol=1e-4)


def test_int4_zero_points_and_the_module_path():
    g = torch.Generator().manual_seed(3)
    n, k, group = 50, 128, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales, zeros = torch.rand(n, k // group, generator=g), torch.randint(0, 16, (n, k // group), generator=g)
    w = QuantizedWeight("int4", q, scales, zeros.float(), group).to(TEST_DEVICE)
    x = torch.randn(2, 5, k, generator=g)  # batched rows, as a layer sees them
    layer = QuantLinear(w, None, triton=True)
    got = layer(x.to(TEST_DEVICE)).cpu()
    torch.testing.assert_close(got, F.linear(x, w.dequantize().cpu()), rtol=1e-4, atol=1e-4)
    assert "triton" in repr(layer)
