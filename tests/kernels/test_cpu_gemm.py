"""The C GEMM for the language model's linears (kernels/cpu_gemm.c), on every ISA variant this CPU
runs, against nn.Linear: row counts across its tiles and row blocks, widths that end mid-panel, K
across its blocks, bias or none, strided and batched inputs; and which modules the engine packs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mm_engine.kernels.cpu_gemm import pack_panels, panel_width
from mm_engine.models.layers.packed_linear import PackedLinear, PanelLinear, panel_linears


def _linear(k: int, n: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    if bias:
        nn.init.normal_(lin.bias)  # the default init is tiny: a bias left out would still pass
    return lin


@pytest.mark.parametrize(
    ("k", "n", "bias"),
    [
        (64, 96, False),  # whole panels
        (576, 100, True),  # the last panel ends mid-way on every variant (48, 16 and 8 wide)
        (40, 5, True),  # one partial panel
        (2048, 4, True),  # the vocabulary-less edge: N below every panel width, three K blocks
        (1000, 130, True),  # two K blocks (768 + 232), the second into a partial panel
        (1600, 48, False),  # three K blocks
    ],
)
@torch.inference_mode()
def test_panel_linear_matches_nn_linear(cpu_lib, k, n, bias):
    lin = _linear(k, n, bias, seed=k + n)
    fast = PanelLinear(lin, cpu_lib)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(1))
    # 1-8 rows: one tile; 9, 20: uneven strips; 96/97/200: across the 96-row blocks
    for rows in (1, 3, 8, 9, 20, 64, 96, 97, 200):
        got = fast(x[:rows])
        assert got.shape == (rows, n) and got.is_contiguous()
        torch.testing.assert_close(got, lin(x[:rows]), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_panel_linear_takes_strided_batched_and_empty_inputs(cpu_lib):
    lin = _linear(72, 60, True, seed=0)
    fast = PanelLinear(lin, cpu_lib)
    wide = torch.randn(11, 100)
    view = wide[:, 10:82]  # rows wider than K: a view into a larger tensor, read in place
    torch.testing.assert_close(fast(view), lin(view), rtol=1e-4, atol=1e-4)
    cols = torch.randn(72, 5).t()  # columns not unit-stride: copied first
    torch.testing.assert_close(fast(cols), lin(cols), rtol=1e-4, atol=1e-4)
    batched = torch.randn(2, 3, 72)
    assert fast(batched).shape == (2, 3, 60)
    torch.testing.assert_close(fast(batched), lin(batched), rtol=1e-4, atol=1e-4)
    assert fast(torch.empty(0, 72)).shape == (0, 60)


def test_panel_linear_names_bad_input(cpu_lib):
    fast = PanelLinear(_linear(8, 4, False, seed=0), cpu_lib)
    with pytest.raises(TypeError, match="float32"):
        fast(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="8 input features"):
        fast(torch.randn(2, 9))


def test_pack_panels_layout(cpu_variant, cpu_lib):
    width = panel_width(cpu_lib)
    assert width == {"avx512": 48, "avx2": 16, "portable": 8}[cpu_variant]
    w = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)  # w[n, k] = 3n + k
    panels = pack_panels(w, width)
    n_panels = -(-50 // width)
    assert panels.shape == (n_panels, 3, width)
    assert panels[0, 2, 5] == w[5, 2] and panels[1, 0, 1] == w[width + 1, 0]
    assert not panels[-1, :, 50 - (n_panels - 1) * width :].any()  # zero columns past N


def test_panel_linears_switch_float32_linears_and_copy_tied_weights(cpu_lib):
    embed, head = nn.Embedding(30, 16), nn.Linear(16, 30, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict(
        {"embed": embed, "head": head, "mlp": nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4).double())}
    )
    assert panel_linears(model, cpu_lib) == 2
    assert isinstance(model["head"], PanelLinear) and isinstance(model["mlp"][0], PanelLinear)
    assert isinstance(model["mlp"][1], nn.Linear)  # float64 stays
    assert model["embed"].weight.shape == (30, 16)  # the tied embedding keeps its weight
    assert "in_features=16, out_features=8, bias=True" in repr(model["mlp"][0])


def test_engine_runs_the_language_model_on_the_c_gemm_and_the_tower_on_onednn(siglip_qwen2):
    from mm_engine import LLM

    fast = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2).engine.core.model
    plain = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2, attention_backend="torch").engine.core.model
    lm_linears = [m for m in fast.language_model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert not lm_linears and isinstance(fast.language_model.lm_head, PanelLinear)
    assert not any(isinstance(m, PanelLinear) for m in fast.vision_tower.modules())
    assert not any(isinstance(m, PanelLinear) for m in plain.modules())  # the reference path keeps oneDNN
    layer, ref = fast.language_model.layers[0], plain.language_model.layers[0]
    x = torch.randn(5, fast.config.text_config.hidden_size, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer.mlp(x), ref.mlp(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.self_attn.qkv_proj(x), ref.self_attn.qkv_proj(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3, 20])  # 20: more threads than the panels (3 on avx512)
def test_gemm_writes_only_its_columns_of_a_wider_output(cpu_lib, threads):
    """Straight to the kernel, into rows wider than N: the columns past N must keep their marker,
    whatever the thread count (the tests otherwise run at the machine's)."""
    lin = _linear(1000, 130, True, seed=5)  # two K blocks, the last panel partial on every variant
    fast = PanelLinear(lin, cpu_lib)
    x = torch.randn(21, 1000, generator=torch.Generator().manual_seed(6))
    y = torch.full((21, 137), 7.0)
    cpu_lib.gemm_panels(
        x.data_ptr(),
        1000,
        fast.panels.data_ptr(),
        fast.bias.data_ptr(),
        y.data_ptr(),
        137,
        21,
        130,
        1000,
        threads,
    )
    torch.testing.assert_close(y[:, :130], lin(x), rtol=1e-4, atol=1e-4)
    assert torch.equal(y[:, 130:], torch.full((21, 7), 7.0))


def test_panel_linear_refuses_weights_it_cannot_pack(cpu_lib):
    with pytest.raises(TypeError, match="float32 CPU weights"):
        PanelLinear(nn.Linear(8, 4).to(torch.bfloat16), cpu_lib)


def test_without_the_kernels_the_platform_is_plain_torch(monkeypatch, siglip_qwen2):
    """No library (no compiler, say): the "cpu" backend runs the torch path, and says so."""
    from mm_engine import LLM
    from mm_engine.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "load", lambda variant=None: None)
    engine = LLM(siglip_qwen2, kv_cache_memory_bytes=4 * 1024**2).engine
    assert engine.core.platform.kernels is None and engine.core.platform.backend.name == "torch"
    assert not any(isinstance(m, PanelLinear) for m in engine.core.model.modules())
    assert "CPU C kernels: none" in engine.core.platform.summary()
