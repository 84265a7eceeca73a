"""The pieces of the Qwen vision towers (models/layers/qwen_vision.py): norms that fuse the
residual add, the MLPs, the attention and the mergers of each version, named as the checkpoints
name them."""

from __future__ import annotations

import torch
from torch import nn

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm
from mm_engine.models.layers.mlp import MLP, FeedForward


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with the residual add the blocks chain through (`RMSNorm.add_and_norm`)."""

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x.add_(delta)
        return x, self(x)


class VisionAttention(nn.Module):
    """Rotary attention over packed images (Qwen's towers, Pixtral's without biases, GLM's with
    `proj_bias` of its own and, in GLM-OCR, an RMSNorm over each head of q and k: `qk_norm_eps`)."""

    def __init__(
        self, dim: int, heads: int, ops: TorchOps, bias: bool = True, proj_bias: bool | None = None,
        qk_norm_eps: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.head_dim, self.ops = heads, dim // heads, ops
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias if proj_bias is None else proj_bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps, ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments):
        tokens, h, hd = x.shape[0], self.heads, self.head_dim
        qkv = self.qkv(x).view(tokens, 3 * h, hd)
        qk = qkv[:, : 2 * h]
        if self.q_norm is not None:
            q = self.q_norm(qk[:, :h].reshape(tokens * h, hd)).view(tokens, h, hd)
            qk = torch.cat([q, self.k_norm(qk[:, h:].reshape(tokens * h, hd)).view(tokens, h, hd)], 1)
        qk = self.ops.rotary(qk, cos, sin)  # q and k heads side by side, one call
        out = self.ops.varlen_attention(qk[:, :h], qk[:, h:], qkv[:, 2 * h :], segments, self.head_dim**-0.5)
        return self.proj(out.view(tokens, -1))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP; the tower chains the residual adds through the norms."""

    def __init__(self, config, version: str, ops: TorchOps) -> None:
        super().__init__()
        rms = version == "qwen2_5"
        dim = config.embed_dim if version == "qwen2" else config.hidden_size
        norm = (lambda: RMSNorm(dim, 1e-6, ops)) if rms else (lambda: LayerNorm(dim, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, config.num_heads, ops)
        if version == "qwen2_5":
            self.mlp = MLP(config, bias=True, ops=ops)
        elif version == "qwen2":
            self.mlp = FeedForward(dim, int(dim * config.mlp_ratio), config.hidden_act, ("fc1", "fc2"), ops)
        else:
            names = ("linear_fc1", "linear_fc2")
            self.mlp = FeedForward(dim, config.intermediate_size, config.hidden_act, names, ops)


class PatchMerger(nn.Module):
    """Qwen2-VL / Qwen2.5-VL: `ln_q` over each patch, then `mlp` (Linear, GELU, Linear) over each
    `merge x merge` patches side by side."""

    def __init__(self, dim: int, out: int, merge: int, rms: bool, ops: TorchOps) -> None:
        super().__init__()
        self.ln_q = RMSNorm(dim, 1e-6, ops) if rms else LayerNorm(dim, eps=1e-6)
        self.wide = dim * merge * merge
        self.mlp = nn.Sequential(nn.Linear(self.wide, self.wide), nn.GELU(), nn.Linear(self.wide, out))

    @property
    def first_norm(self) -> nn.Module:
        return self.ln_q

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        return self.mlp(normed.view(-1, self.wide))


class Qwen3Merger(nn.Module):
    """Qwen3-VL / Qwen3.5: `norm`, `linear_fc1`, GELU, `linear_fc2`. The final merger norms each
    patch; a DeepStack merger (`postshuffle`) norms the `merge x merge` patches side by side."""

    def __init__(self, dim: int, out: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.wide = dim * merge * merge
        self.norm = LayerNorm(self.wide if postshuffle else dim, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = nn.Linear(self.wide, self.wide), nn.Linear(self.wide, out)
        self.act = nn.GELU()

    @property
    def first_norm(self) -> nn.Module:
        return self.norm

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(normed.view(-1, self.wide))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A DeepStack tap: the blocks' residual stream -> this layer's features."""
        return self.project(self.norm(x.reshape(-1, self.wide)))
