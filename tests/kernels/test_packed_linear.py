"""oneDNN linears with packed weights: the same function as nn.Linear, any row count, weights that
are tied elsewhere left in place."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mm_engine.models.layers.packed_linear import PackedLinear, can_pack, onednn_bf16, pack_linears

# A torch built without oneDNN (mkldnn) has no packed path: the engine keeps plain nn.Linear there
# and there is nothing of this module's to test. The pinned torch wheels have oneDNN.
pytestmark = pytest.mark.skipif(
    not can_pack(nn.Linear(2, 2)), reason="torch without oneDNN: the engine uses plain nn.Linear"
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    embed = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embed.weight  # tied, as small LMs do
    return nn.ModuleDict(
        {"embed": embed, "mlp": nn.Sequential(nn.Linear(16, 40), nn.SiLU(), nn.Linear(40, 16)), "head": head}
    )


@torch.inference_mode()
def test_packed_model_computes_what_nn_linear_computes_for_any_row_count():
    model = _model()
    x = torch.randn(300, 16)
    want = {n: model["head"](model["mlp"](x[:n])) for n in (1, 7, 64, 300)}
    assert pack_linears(model) == 3
    assert isinstance(model["mlp"][0], PackedLinear) and isinstance(model["head"], PackedLinear)
    for n, ref in want.items():
        torch.testing.assert_close(model["head"](model["mlp"](x[:n])), ref, rtol=1e-4, atol=1e-5)
    assert model["embed"].weight.shape == (50, 16)  # the tied embedding keeps its weight
    assert "in_features=16, out_features=40, bias=True" in repr(model["mlp"][0])


@pytest.mark.skipif(
    not onednn_bf16(), reason="this CPU has no bf16 instructions oneDNN can use (AVX-512 or AVX-NE-CONVERT)"
)
@torch.inference_mode()
def test_packed_linear_takes_batched_inputs_and_bfloat16():
    lin = nn.Linear(8, 12).to(torch.bfloat16)
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    ref = lin(x)
    packed = PackedLinear(lin)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed(x), ref, rtol=2e-2, atol=2e-2)


def test_nothing_but_cpu_float_linears_is_packed():
    model = nn.Sequential(nn.Linear(4, 4).double(), nn.Linear(4, 4))
    assert pack_linears(model) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)


def test_bfloat16_weights_stay_plain_where_onednn_has_no_bf16(monkeypatch):
    """On an AVX2-only CPU oneDNN refuses the bf16 reorder: such a layer keeps nn.Linear instead
    of failing the model's load."""
    from mm_engine.models.layers import packed_linear

    monkeypatch.setattr(packed_linear, "onednn_bf16", lambda: False)
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4))
    assert pack_linears(model) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)
