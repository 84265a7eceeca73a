"""The mixture-of-experts layer (models/layers/moe.py): grouped by expert, it equals the plain
per-token definition (softmax over experts, top-k, renormalised, weighted sum of SwiGLU experts),
and a tensor-parallel split of every expert's width sums back to the whole."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mm_engine.models.layers.moe import SparseMoE, is_sparse
from mm_engine.parallel.group import TPGroup
from mm_engine.parallel.shard import shard_state

CONFIG = SimpleNamespace(num_experts=6, num_experts_per_tok=2, hidden_size=16, moe_intermediate_size=8,
                         hidden_act="silu", norm_topk_prob=None)  # fmt: skip


def _random_moe(seed: int = 0, tp: TPGroup | None = None) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoE(CONFIG, tp=tp)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = (moe.gate.weight @ x[t]).softmax(-1)
        top = probs.topk(CONFIG.num_experts_per_tok)
        for w, e in zip(top.values / top.values.sum(), top.indices.tolist(), strict=True):
            gate, up = (x[t] @ moe.experts.gate_up_proj[e]).chunk(2)
            out[t] += w * ((torch.nn.functional.silu(gate) * up) @ moe.experts.down_proj[e])
    return out


def test_grouped_experts_equal_the_per_token_definition():
    moe = _random_moe()
    x = torch.randn(37, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), _reference(moe, x), rtol=1e-4, atol=1e-4)
    assert moe(x[:0]).shape == (0, CONFIG.hidden_size)  # an empty batch (a step with no tokens here)


def test_a_split_of_every_experts_width_sums_to_the_whole():
    whole = _random_moe()
    x = torch.randn(9, CONFIG.hidden_size, generator=torch.Generator().manual_seed(2))
    parts = []
    for rank in range(2):
        tp = TPGroup(rank, 2, torch.device("cpu"))
        shard = SparseMoE(CONFIG, tp=tp)
        shard.load_state_dict(shard_state(dict(whole.state_dict()), shard, tp))
        shard.tp = None  # summed here instead of by a collective
        parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), rtol=1e-4, atol=1e-4)


def test_which_layers_are_sparse():
    cfg = SimpleNamespace(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_sparse(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not is_sparse(SimpleNamespace(num_experts=0), 0)


def test_both_expert_layouts_load_as_the_published_one():
    from mm_engine.models.layers.moe import checkpoint_layout

    narrow = SimpleNamespace(**{**vars(CONFIG), "moe_intermediate_size": 4})  # 2 x 4 != hidden 16
    published = dict(SparseMoE(narrow).state_dict())
    published = {k: torch.randn(v.shape) for k, v in published.items()}
    transposed = {k: v.transpose(-1, -2) if "experts" in k else v for k, v in published.items()}
    for state in (published, transposed):  # hub checkpoints, and what transformers 5 saves
        loaded = checkpoint_layout(state, narrow)
        assert all(torch.equal(loaded[k], published[k]) for k in published)


def test_the_shared_expert_and_per_expert_checkpoints_equal_transformers_qwen3_5_moe_block():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from mm_engine.models.layers.moe import checkpoint_layout

    cfg = Qwen3_5MoeTextConfig(hidden_size=16, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=8,
                               shared_expert_intermediate_size=12)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    ref = Qwen3_5MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    # As published: one tensor per expert and projection.
    e = cfg.num_experts
    gate, up = ref.experts.gate_up_proj.detach().chunk(2, dim=1)  # transformers' [experts, 2 x width, hidden]
    down = ref.experts.down_proj.detach()
    projections = (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
    state = {f"mlp.experts.{i}.{name}.weight": t[i] for i in range(e) for name, t in projections}
    state.update({f"mlp.{k}": v for k, v in ref.state_dict().items() if not k.startswith("experts.")})
    state = {k.removeprefix("mlp."): v for k, v in checkpoint_layout(state, cfg).items()}
    moe = SparseMoE(cfg)
    moe.load_state_dict(state)
    moe.fuse()
    x = torch.randn(11, 16, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x[None])[0], rtol=1e-5, atol=1e-5)


def test_glm_grouped_router_and_shared_experts_equal_transformers_glm4v_moe_block():
    """GLM-4.5V's block: sigmoid scores chosen within the best groups (shifted by the score
    correction), renormalised and scaled, plus the ungated shared experts; experts as transformers
    saves them (transposed)."""
    from transformers import Glm4vMoeTextConfig
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextMoE

    from mm_engine.models.layers.moe import checkpoint_layout

    cfg = Glm4vMoeTextConfig(
        hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=6,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, hidden_act="silu",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    ref = Glm4vMoeTextMoE(cfg).eval()
    with torch.no_grad():
        for name, t in (*ref.named_parameters(), *ref.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=gen) * (0.3 if "bias" in name else 1.0))
    moe = SparseMoE(cfg)
    moe.load_state_dict(checkpoint_layout(dict(ref.state_dict()), cfg))
    moe.fuse()
    x = torch.randn(13, 16, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x[None])[0], rtol=1e-5, atol=1e-5)
    assert [is_sparse(cfg, i) for i in range(3)] == [False, True, True]  # first_k_dense_replace 1
