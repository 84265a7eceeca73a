"""The fused C activations (kernels/cpu_elementwise.c) against torch's, extremes included: a
-ffast-math reciprocal of an overflowed exp would be NaN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_engine.kernels import cpu_build, cpu_elementwise
from mm_engine.layers import MLP

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


def test_fused_activations_switch_the_mlps_and_keep_their_outputs(siglip_qwen2):
    from mm_engine import LLM

    fast = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2).engine.model
    plain = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2, attention_backend="torch").engine.model
    lm_mlps = [m for m in fast.modules() if isinstance(m, MLP)]
    assert lm_mlps and all(m.act_and_mul is cpu_elementwise.silu_and_mul for m in lm_mlps)
    layers = fast.vision_tower.encoder.layers
    assert all(isinstance(layer.mlp.activation_fn, cpu_elementwise.InplaceGeluTanh) for layer in layers)
    assert not any(isinstance(m, cpu_elementwise.InplaceGeluTanh) for m in plain.modules())
    size = fast.config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    want = plain.encode_images(pixels)
    torch.testing.assert_close(fast.encode_images(pixels), want, rtol=1e-3, atol=5e-5)
    x = torch.randn(7, fast.config.text_config.hidden_size, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(lm_mlps[0](x), [m for m in plain.modules() if isinstance(m, MLP)][0](x))
