"""The fused C passes (kernels/cpu_elementwise.c) against torch's: activations with extremes
included (a -ffast-math reciprocal of an overflowed exp would be NaN), RMSNorm with and without
the residual add, rotary in place on a view into the fused projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_engine.kernels import cpu_build, cpu_elementwise
from mm_engine.layers import MLP, Attention, RMSNorm, apply_rotary

EXTREMES = torch.tensor([100.0, -100.0, 1e-30, 0.0, -1e4, 1e4, 88.0, -88.0])


def _inputs(rows: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 4
    x[0, : len(EXTREMES)] = EXTREMES
    return x


def test_silu_and_mul_matches_torch_over_strided_rows_and_extremes():
    assert cpu_build.load() is not None, "the C kernels must build where the tests run (cc on PATH)"
    wide = _inputs(37, 3 * 96, seed=0)
    x = wide[:, : 2 * 96]  # rows wider than gate + up, as a view of a larger output would be
    gate, up = x.chunk(2, dim=-1)
    got = cpu_elementwise.silu_and_mul(x)
    assert got is not None and got.is_contiguous() and got.shape == (37, 96)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    gate_extremes = torch.cat([EXTREMES, torch.zeros(88)])  # in the gate half of a fresh row
    row = torch.stack([gate_extremes, torch.ones(96)]).reshape(1, -1)
    torch.testing.assert_close(cpu_elementwise.silu_and_mul(row), F.silu(gate_extremes)[None])
    assert cpu_elementwise.silu_and_mul(x.double()) is None  # the caller's torch path takes it
    assert cpu_elementwise.silu_and_mul(torch.randn(3, 5)) is None  # no even split


def test_gelu_tanh_in_place_matches_torch_and_falls_back_off_its_path():
    x = _inputs(29, 160, seed=1)
    want = F.gelu(x, approximate="tanh")
    act = cpu_elementwise.InplaceGeluTanh()
    y = x.clone()
    assert act(y) is y  # in place
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    strided = x.t()  # not contiguous: torch computes it, the input is left alone
    torch.testing.assert_close(act(strided), want.t())
    torch.testing.assert_close(strided, x.t())


def test_rms_norm_with_and_without_the_residual_add_matches_torch():
    g = torch.Generator().manual_seed(4)
    for rows in (1, 5, 300):  # one thread below the kernel's threshold, both above it
        x, delta = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
        w = torch.rand(576, generator=g) + 0.5
        want = x + delta
        s, out = cpu_elementwise.rms_norm(x, w, 1e-6, delta)
        assert s is x and torch.equal(x, want)  # the residual stream, added to in place
        torch.testing.assert_close(out, F.rms_norm(want, (576,), w, 1e-6), rtol=1e-5, atol=1e-6)
        plain = cpu_elementwise.rms_norm(x, w, 1e-6)
        assert plain[0] is x
        torch.testing.assert_close(plain[1], F.rms_norm(x, (576,), w, 1e-6), rtol=1e-5, atol=1e-6)
    assert cpu_elementwise.rms_norm(x.t(), w, 1e-6) is None  # not contiguous: torch's turn
    assert cpu_elementwise.rms_norm(x.double(), w.double(), 1e-6) is None


def test_rotary_in_place_on_the_fused_projection_view_matches_torch():
    g = torch.Generator().manual_seed(5)
    t, heads, kvh, d = 70, 4, 2, 64
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g)
    cos, sin = torch.randn(t, 1, d // 2, generator=g), torch.randn(t, 1, d // 2, generator=g)
    qk = qkv[:, : (heads + kvh) * d].view(t, heads + kvh, d)
    want, v_before = apply_rotary(qk, (cos, sin)), qkv[:, (heads + kvh) * d :].clone()
    assert cpu_elementwise.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kvh) * d :], v_before)  # v, beside them, untouched
    assert not cpu_elementwise.rotary_(qk.double(), cos.double(), sin.double())


def test_c_kernels_switch_the_model_and_keep_its_outputs(siglip_qwen2):
    from mm_engine import LLM

    fast = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2).engine.model
    plain = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2, attention_backend="torch").engine.model
    lm_mlps = [m for m in fast.modules() if isinstance(m, MLP)]
    assert lm_mlps and all(m.act_and_mul is cpu_elementwise.silu_and_mul for m in lm_mlps)
    assert all(m.c_kernels for m in fast.modules() if isinstance(m, (RMSNorm, Attention)))
    assert not any(m.c_kernels for m in plain.modules() if isinstance(m, (RMSNorm, Attention)))
    layers = fast.vision_tower.encoder.layers
    assert all(isinstance(layer.mlp.activation_fn, cpu_elementwise.InplaceGeluTanh) for layer in layers)
    assert not any(isinstance(m, cpu_elementwise.InplaceGeluTanh) for m in plain.modules())
    size = fast.config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    want = plain.encode_images(pixels)
    torch.testing.assert_close(fast.encode_images(pixels), want, rtol=1e-3, atol=5e-5)
    x = torch.randn(7, fast.config.text_config.hidden_size, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(lm_mlps[0](x), [m for m in plain.modules() if isinstance(m, MLP)][0](x))
