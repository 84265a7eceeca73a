"""The int8-input GEMM (kernels/cpu_qgemm_a8.c: AVX-512 VNNI for int8 and int4 weights, AVX2 for
int4) on every variant this CPU runs that takes the weight kind, against the path it replaces:
the input fake-quantized as compressed-tensors does (act_quant.py), times the dequantized weight.
Symmetric int4 and int4 with zero points, per-group and per-row groups, widths that end mid-panel,
row counts across its 4-row tiles, bias, a static input scale, a strided input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mm_engine.kernels import cpu_qgemm_a8
from mm_engine.models.layers.act_quant import fake_quantize
from mm_engine.models.layers.quant_linear import QuantizedWeight, QuantLinear, quantize

WHY_NOT = {
    "avx2": "avx2 takes int4 weights only: vpmaddubsw's 16-bit pair sums would saturate on int8 weights",
    "portable": "the portable build has no integer kernel: int8 inputs run the float path there",
    "avx512": "this AVX-512 CPU lacks VNNI: int8 inputs run the float path here",
}


def _taking(variant: str, lib, kind: str) -> None:
    """Skip where the variant does not take `kind`: those layers keep the fake-quantized float path,
    tested below (test_weights_whose_groups...) and in tests/engine/test_quantization.py."""
    if not cpu_qgemm_a8.available(lib, kind):
        pytest.skip(WHY_NOT[variant])


def _case(kind: str, n: int, k: int, group: int | None, zeros: bool, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g), kind, group)
    if zeros:  # int4 with a zero point per column and group (AWQ, asymmetric GPTQ)
        w.zeros = torch.randint(0, 16, w.scales.shape, generator=g).float()
    w.act = "int8"
    return w


@pytest.mark.parametrize(("kind", "zeros"), [("int8", False), ("int4", False), ("int4", True)])
@pytest.mark.parametrize(
    ("n", "k", "group"), [(100, 256, None), (48, 128, 32), (7, 64, 64), (130, 1024, None)]
)
@torch.inference_mode()
def test_the_int8_input_kernel_equals_the_fake_quantized_path(cpu_variant, cpu_lib, kind, zeros, n, k, group):
    _taking(cpu_variant, cpu_lib, kind)
    w = _case(kind, n, k, group, zeros, seed=n + k)
    bias = torch.randn(n)
    fast = QuantLinear(w, bias, cpu_lib)
    assert fast.a8 is not None and fast.panels is None
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(2)) * 3
    x[4] = 0  # a zero row: its scale is eps, its output the bias
    for rows in (1, 2, 3, 4, 5, 8, 11):
        want = F.linear(fake_quantize(x[:rows], "int8"), w.dequantize(), bias)
        torch.testing.assert_close(fast(x[:rows]), want, rtol=1e-5, atol=1e-5 * k**0.5)
    wide = torch.randn(3, k + 5)[:, 5:]  # rows a view into a wider tensor
    torch.testing.assert_close(
        fast(wide), F.linear(fake_quantize(wide, "int8"), w.dequantize(), bias), rtol=1e-5, atol=1e-4
    )
    assert fast(x[:0]).shape == (0, n)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@torch.inference_mode()
def test_a_static_input_scale_is_used_as_given(cpu_variant, cpu_lib, kind):
    _taking(cpu_variant, cpu_lib, kind)
    w = _case(kind, 64, 128, None, False, seed=7)
    w.act_scale = torch.tensor([0.01])  # small: many inputs clamp to the int8 range
    fast = QuantLinear(w, None, cpu_lib)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    want = F.linear(fake_quantize(x, "int8", w.act_scale), w.dequantize())
    torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-4)


def test_weights_whose_groups_are_not_whole_lanes_keep_the_float_path(cpu_lib):
    """Everywhere: a group that is not a multiple of the lanes' k (4 for int8, 8 for int4) or a
    variant without the kernel keeps the weight-only kernel behind the fake quantization; int4
    with K off whole words (8 k) takes neither kernel and dequantizes."""
    w = _case("int8", 16, 10, 10, False, seed=1)  # K = 10: one group of 10, not 4-divisible
    layer = QuantLinear(w, None, cpu_lib)
    assert layer.a8 is None and layer.panels is not None
    x = torch.randn(2, 10)
    torch.testing.assert_close(
        layer(x), F.linear(fake_quantize(x, "int8"), w.dequantize()), rtol=1e-5, atol=1e-5
    )
    w = _case("int4", 16, 12, 12, False, seed=1)  # K = 12: one group of 12, not 8-divisible
    layer = QuantLinear(w, None, cpu_lib)
    assert layer.a8 is None and layer.panels is None and layer.weight_q is w
    x = torch.randn(2, 12)
    torch.testing.assert_close(
        layer(x), F.linear(fake_quantize(x, "int8"), w.dequantize()), rtol=1e-5, atol=1e-5
    )
    assert not cpu_qgemm_a8.fits("int4", 12, 12) and cpu_qgemm_a8.fits("int8", 12, 12)


def test_each_variant_takes_the_kinds_its_instructions_sum_exactly(cpu_variant, cpu_lib):
    """avx2's vpmaddubsw pairs saturate past 32767: int4 weights (at most 15) fit, int8 (x + 128
    up to 255) do not; AVX-512 VNNI never saturates; the portable build has none."""
    int8, int4 = (cpu_qgemm_a8.available(cpu_lib, kind) for kind in ("int8", "int4"))
    expected = {"avx2": (False, True), "portable": (False, False)}.get(cpu_variant, (int4, int4))
    assert (int8, int4) == expected
    assert not cpu_qgemm_a8.available(cpu_lib, "fp8") and not cpu_qgemm_a8.available(None, "int4")
