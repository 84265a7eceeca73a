"""Mixture-of-experts feed-forward (Qwen3-VL-MoE's, Qwen3.5-MoE's, GLM-4.5V's): a router scores
every expert for each token, the top `num_experts_per_tok` are kept (softmax, renormalised over
them with `norm_topk_prob`; GLM: sigmoid scores chosen within the best groups, `_GroupedRouter`),
and the token's output is their weighted sum (Qwen3.5-MoE adds a shared expert that every token
goes through, scaled by a sigmoid gate; GLM shared experts, ungated).

Grouped: the (token, expert) pairs are sorted by expert and handed to the ops (`moe_experts`):
torch runs each expert that any token chose once, as one matmul pair over all of its tokens (the
loop is over experts with work, never over tokens); Triton runs every expert in one launch per
matmul (kernels/triton_moe.py).

Weights are kept as Qwen3-VL-MoE's published checkpoints store them (transformers' own layout is
transposed on load, and per-expert tensors stacked, `checkpoint_layout`): `experts.gate_up_proj`
`[experts, hidden, 2 x intermediate]` (gate, then up) and `experts.down_proj` `[experts,
intermediate, hidden]`, so `x @ w` needs no transpose. The router is a plain parameter, never a
packed linear: routing is a discrete choice, and it must see the very logits transformers
computes. With `tp`, each expert's intermediate dimension is split (gate and up by columns, down
by rows) and the ranks' outputs summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.ops import TORCH_OPS, TorchOps
from mm_engine.models.layers.mlp import MLP
from mm_engine.parallel.group import TPGroup


def num_experts(config) -> int:
    """Routed experts per layer (`num_experts`, or GLM's `n_routed_experts`); 0: a dense model."""
    return getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0


def is_sparse(config, layer: int) -> bool:
    """Whether decoder layer `layer` has experts (transformers' rules: the Qwen MoE line's sparse
    step and dense layers, GLM's first `first_k_dense_replace` layers dense)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = getattr(config, "mlp_only_layers", None) or []
    first = getattr(config, "first_k_dense_replace", 0) or 0
    return num_experts(config) > 0 and layer >= first and layer not in dense and (layer + 1) % step == 0


def _stack_experts(state: dict) -> dict:
    """Per-expert tensors (`experts.N.gate_proj.weight` `[width, hidden]`, `up_proj`, `down_proj`
    `[hidden, width]`: Qwen3.5-MoE's published layout) stacked into this layer's two tensors."""
    out, groups = {}, {}
    for key, ref in state.items():
        head, sep, tail = key.partition(".experts.")
        num, _, name = tail.partition(".")
        if sep and num.isdigit() and name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            groups.setdefault(head, {})[(int(num), name)] = ref
        else:
            out[key] = ref
    for head, parts in groups.items():
        n = 1 + max(i for i, _ in parts)
        gate, up, down = (
            [_load(parts[(i, f"{p}.weight")]) for i in range(n)]
            for p in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{head}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g.t(), u.t()], dim=-1) for g, u in zip(gate, up, strict=True)]
        )
        out[f"{head}.experts.down_proj"] = torch.stack([d.t() for d in down]).contiguous()
    return out


def _load(ref) -> torch.Tensor:
    return ref.load() if hasattr(ref, "load") else ref


def checkpoint_layout(state: dict, config) -> dict:
    """`state` with every expert tensor in the layout this layer keeps. Published checkpoints
    store `[experts, hidden, 2 x width]` and `[experts, width, hidden]`; transformers 5 keeps (and
    saves) them transposed. The shape tells which, unless hidden equals the other side, where the
    published layout is assumed."""
    hidden, width = config.hidden_size, config.moe_intermediate_size
    state = _stack_experts(state)
    out = dict(state)
    for key, ref in state.items():
        if key.endswith("experts.gate_up_proj"):
            want = (hidden, 2 * width)
        elif key.endswith("experts.down_proj"):
            want = (width, hidden)
        else:
            continue
        shape = tuple(ref.shape[-2:])
        if shape != want and shape == want[::-1]:
            out[key] = _load(ref).transpose(-1, -2).contiguous()
    return out


class SparseMoE(nn.Module):
    def __init__(
        self, config, ops: TorchOps = TORCH_OPS, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        experts, hidden = num_experts(config), config.hidden_size
        width = config.moe_intermediate_size // (tp.world if tp is not None else 1)
        self.top_k = config.num_experts_per_tok
        self.renormalise = getattr(config, "norm_topk_prob", None) is not False  # Qwen3-VL-MoE: always
        grouped = getattr(config, "n_group", None) is not None  # GLM-4.5V / 4.6V (DeepSeek-V3's routing)
        self.gate = _GroupedRouter(config, dtype) if grouped else _Router(experts, hidden, dtype)
        self.experts = Experts(experts, hidden, width, dtype)
        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"  # the ops' fused SiLU-and-multiply
        self.ops, self.tp = ops, tp
        # Qwen3.5-MoE: one expert every token goes through, its output scaled by a sigmoid gate.
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = (
            MLP(config, False, ops, tp, dtype, width=shared, reduce=False) if shared else None
        )
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if shared else None
        # GLM: `n_shared_experts` experts' worth of width every token goes through, ungated.
        always = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        self.shared_experts = (
            MLP(config, False, ops, tp, dtype, width=always, reduce=False) if always else None
        )

    def fuse(self) -> None:
        """The routed experts' gate and up are one tensor already; the shared expert's become one."""
        for shared in (self.shared_expert, self.shared_experts):
            if shared is not None:
                shared.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate.route(x, self.top_k, self.renormalise)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens in order within each
        token = order // self.top_k
        act = None if self.silu else self.act
        out_rows = self.ops.moe_experts(
            x, token, flat[order], self.experts.gate_up_proj, self.experts.down_proj, act
        )
        out = torch.zeros_like(x)
        out.index_add_(0, token, out_rows * weights.reshape(-1)[order, None])
        if self.shared_expert is not None:  # (under tp a partial sum too: one reduce for both)
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class _Router(nn.Module):
    """`gate.weight` `[experts, hidden]`, as transformers' top-k router."""

    def __init__(self, experts: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=dtype))

    def route(self, x: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts `[tokens, k]` and their weights, in x's dtype."""
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(k, dim=-1)
        if renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen


class _GroupedRouter(nn.Module):
    """GLM-4.5V's (DeepSeek-V3's) router: `gate.weight` `[experts, hidden]` scores each expert
    with a sigmoid (float32); a learned `e_score_correction_bias` shifts the scores used to choose
    (not the weights); the experts form `n_group` groups ranked by their two best shifted scores,
    the top `topk_group` groups are kept, and the top k experts among them chosen; their sigmoid
    scores, renormalised, times `routed_scaling_factor`, are the weights."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        experts = num_experts(config)
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))
        self.groups, self.top_groups = config.n_group, config.topk_group
        self.scale = config.routed_scaling_factor

    def route(self, x: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        tokens, experts = scores.shape
        shifted = (scores + self.e_score_correction_bias.float()).view(tokens, self.groups, -1)
        best = shifted.topk(2, dim=-1)[0].sum(dim=-1).topk(self.top_groups, dim=-1)[1]
        keep = torch.zeros(tokens, self.groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
        chosen = shifted.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts).topk(k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(x.dtype), chosen


class Experts(nn.Module):
    """Every expert's gate and up `[experts, hidden, 2 x width]`, its down `[experts, width, hidden]`."""

    def __init__(self, experts: int, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num = experts
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * width, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(experts, width, hidden, dtype=dtype))
