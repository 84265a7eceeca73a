"""The fused C passes (kernels/cpu_elementwise.c), on every ISA variant this CPU runs, against
torch's: activations with extremes included (infinities, NaN, exp's overflow and underflow),
RMSNorm with and without the residual add, rotary in place on a view into the fused projection
output, at the head sizes real checkpoints use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mm_engine.kernels import cpu_elementwise
from mm_engine.kernels.ops import TORCH_OPS, CpuOps
from mm_engine.models.layers.mlp import MLP

INF, NAN = float("inf"), float("nan")
EXTREMES = torch.tensor([100.0, -100.0, 1e-30, 0.0, -1e4, 1e4, 88.0, -88.0, 87.5, -87.5, INF, -INF, NAN])


def _inputs(rows: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 4
    x[0, : len(EXTREMES)] = EXTREMES
    return x


@pytest.mark.slow
def test_silu_and_mul_matches_torch_over_strided_rows_and_extremes(cpu_lib):
    wide = _inputs(37, 3 * 96, seed=0)
    x = wide[:, : 2 * 96]  # rows wider than gate + up, as a view of a larger output would be
    gate, up = x.chunk(2, dim=-1)
    got = cpu_elementwise.silu_and_mul(cpu_lib, x)
    assert got is not None and got.is_contiguous() and got.shape == (37, 96)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5, equal_nan=True)
    gate_extremes = torch.cat([EXTREMES, torch.zeros(96 - len(EXTREMES))])  # the gate half of a row
    row = torch.stack([gate_extremes, torch.ones(96)]).reshape(1, -1)
    torch.testing.assert_close(
        cpu_elementwise.silu_and_mul(cpu_lib, row), F.silu(gate_extremes)[None], equal_nan=True
    )
    assert cpu_elementwise.silu_and_mul(cpu_lib, x.double()) is None  # the caller's torch path takes it
    assert cpu_elementwise.silu_and_mul(cpu_lib, torch.randn(3, 5)) is None  # no even split


def test_gelu_tanh_in_place_matches_torch_and_falls_back_off_its_path(cpu_kernels):
    x = _inputs(29, 160, seed=1)
    want = F.gelu(x, approximate="tanh")
    act = CpuOps(cpu_kernels).gelu_tanh
    y = x.clone()
    assert act(y) is y  # in place
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert y[0, 4] == 0 and y[0, 11].isnan()  # gelu(-1e4) is 0, gelu(-inf) NaN as in torch
    strided = x.t()  # not contiguous: torch computes it, the input is left alone
    torch.testing.assert_close(act(strided), want.t(), equal_nan=True)
    torch.testing.assert_close(strided, x.t(), equal_nan=True)


def test_exp_edges_through_softmax_free_paths_stay_ieee(cpu_lib):
    """silu(x) = x / (1 + exp(-x)) at the edges of exp's range and past them, where a fast-math
    build returned garbage: exp(88.5) overflows to inf (x / inf = -0), exp(-87.5) underflows."""
    x = torch.tensor([-88.5, -87.5, -87.0, 87.0, 88.0, 88.5, 89.0, -1e30, 1e30] + [0.5] * 7)
    row = torch.cat([x, torch.ones(16)])[None]
    got = cpu_elementwise.silu_and_mul(cpu_lib, row)
    torch.testing.assert_close(got, F.silu(x)[None], rtol=1e-6, atol=1e-30)


def test_rms_norm_with_and_without_the_residual_add_matches_torch(cpu_lib):
    g = torch.Generator().manual_seed(4)
    for rows in (1, 5, 300):  # one thread below the kernel's threshold, both above it
        x, delta = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
        w = torch.rand(576, generator=g) + 0.5
        want = x + delta
        s, out = cpu_elementwise.rms_norm(cpu_lib, x, w, 1e-6, delta)
        assert s is x and torch.equal(x, want)  # the residual stream, added to in place
        torch.testing.assert_close(out, F.rms_norm(want, (576,), w, 1e-6), rtol=1e-5, atol=1e-6)
        plain = cpu_elementwise.rms_norm(cpu_lib, x, w, 1e-6)
        assert plain[0] is x
        torch.testing.assert_close(plain[1], F.rms_norm(x, (576,), w, 1e-6), rtol=1e-5, atol=1e-6)
    assert cpu_elementwise.rms_norm(cpu_lib, x.t(), w, 1e-6) is None  # not contiguous: torch's turn
    assert cpu_elementwise.rms_norm(cpu_lib, x.double(), w.double(), 1e-6) is None


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
def test_rotary_in_place_on_the_fused_projection_view_matches_torch(cpu_lib, d):
    g = torch.Generator().manual_seed(5)
    t, heads, kvh = 70, 4, 2
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g)
    cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
    qk = qkv[:, : (heads + kvh) * d].view(t, heads + kvh, d)
    want, v_before = TORCH_OPS.rotary(qk, cos, sin), qkv[:, (heads + kvh) * d :].clone()
    assert cpu_elementwise.rotary_(cpu_lib, qk, cos, sin)
    torch.testing.assert_close(qk, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kvh) * d :], v_before)  # v, beside them, untouched
    assert not cpu_elementwise.rotary_(cpu_lib, qk.double(), cos.double(), sin.double())


def test_the_platform_fills_the_models_ops_and_keeps_its_outputs(siglip_qwen2):
    from mm_engine import LLM

    fast = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2).engine.core.model
    plain = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2, attention_backend="torch").engine.core.model
    lm_mlps = [m for m in fast.modules() if isinstance(m, MLP)]
    assert lm_mlps and all(isinstance(m.ops, CpuOps) for m in lm_mlps)
    assert all(m.ops is TORCH_OPS for m in plain.modules() if hasattr(m, "ops"))
    layers = fast.vision_tower.layers  # the engine's own SigLIP tower: tanh-GELU through the ops
    assert all(layer.mlp.act == layer.self_attn.ops.gelu_tanh for layer in layers)
    assert all(isinstance(layer.self_attn.ops, CpuOps) for layer in layers)
    size = fast.config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    want = plain.encode_images(pixels)
    torch.testing.assert_close(fast.encode_images(pixels), want, rtol=1e-3, atol=5e-5)
    x = torch.randn(7, fast.config.text_config.hidden_size, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(lm_mlps[0](x), [m for m in plain.modules() if isinstance(m, MLP)][0](x))
