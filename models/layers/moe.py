"""Mixture-of-experts feed-forward (Qwen3-VL-MoE's, Qwen3.5-MoE's): a router scores every expert
for each token, the top `num_experts_per_tok` are kept (softmax, renormalised over them with
`norm_topk_prob`), and the token's output is their weighted sum (Qwen3.5-MoE adds a shared expert
that every token goes through, scaled by a sigmoid gate).

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


def is_sparse(config, layer: int) -> bool:
    """Whether decoder layer `layer` has experts (transformers' rule for the Qwen MoE line)."""
    experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = getattr(config, "mlp_only_layers", None) or []
    return experts > 0 and layer not in dense and (layer + 1) % step == 0


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
        experts, hidden = config.num_experts, config.hidden_size
        width = config.moe_intermediate_size // (tp.world if tp is not None else 1)
        self.top_k = config.num_experts_per_tok
        self.renormalise = getattr(config, "norm_topk_prob", None) is not False  # Qwen3-VL-MoE: always
        self.gate = _Router(experts, hidden, dtype)
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

    def fuse(self) -> None:
        """The routed experts' gate and up are one tensor already; the shared expert's become one."""
        if self.shared_expert is not None:
            self.shared_expert.fuse()

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


class Experts(nn.Module):
    """Every expert's gate and up `[experts, hidden, 2 x width]`, its down `[experts, width, hidden]`."""

    def __init__(self, experts: int, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num = experts
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * width, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(experts, width, hidden, dtype=dtype))
