"""Gemma 4's mixture of experts (the 26B-A4B): in each layer a routed block beside the dense MLP,
both read the same residual stream and their normed outputs are summed before the layer's
post-feed-forward norm (models/layers/gemma4.py).

The router RMS-norms the stream (no weight), scales it by `scale` / sqrt(hidden), scores every
expert (`proj`), keeps the top `top_k_experts` of the softmax (float32), renormalises them and
multiplies each by its expert's `per_expert_scale`. The experts (GeGLU) run grouped through the
ops as the Qwen MoE's do (models/layers/moe.py: the same `Experts` layout, transformers'
transposed on load, each expert's width split under `tp`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.moe import Experts
from mm_engine.parallel.group import TPGroup


class Gemma4Router(nn.Module):
    def __init__(self, config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        # A plain parameter, never a packed or quantized linear: routing is a discrete choice and
        # must see the very scores transformers computes.
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=dtype))
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(experts, dtype=dtype))
        self.eps, self.top_k, self.root = config.rms_norm_eps, config.top_k_experts, hidden**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts `[tokens, k]` and their weights (float32)."""
        xf = x.float()
        normed = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        scores = nn.functional.linear(normed * self.scale * self.root, self.proj.weight)
        weights, chosen = scores.softmax(dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


class Gemma4Experts(Experts):
    """`forward(x, weights, chosen)`: the routed experts' weighted sum (summed over `tp` ranks)."""

    def __init__(self, config, ops: TorchOps, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        width = config.moe_intermediate_size // (tp.world if tp is not None else 1)
        super().__init__(config.num_experts, config.hidden_size, width, dtype)
        self.act, self.ops, self.tp = ACT2FN[config.hidden_activation], ops, tp

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens in order within each
        token = order // k
        rows = self.ops.moe_experts(x, token, flat[order], self.gate_up_proj, self.down_proj, self.act)
        out = torch.zeros_like(x)
        out.index_add_(0, token, (rows * weights.reshape(-1)[order, None]).to(x.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)
