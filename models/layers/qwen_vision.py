"""The Qwen2-VL and Qwen2.5-VL vision transformer on the engine's layers and ops.

All images of a step run as one packed sequence: the patch embedding (a 3-D convolution whose
stride is its kernel, so one matmul over flattened patches), blocks of pre-norm attention and
MLP, and the merger (every `merge x merge` patches -> one language-model token). Attention is one
call per layer over every segment of the step (`ops.varlen_attention`: whole frames, or Qwen2.5's
windows), never padded; the 2-D rotary turns q and k in place inside the fused QKV output; the
residual add and the next norm are one pass (`RMSNorm.add_and_norm`). What differs between the two:

| | Qwen2-VL | Qwen2.5-VL |
|---|---|---|
| norms | LayerNorm | RMSNorm |
| MLP | fc1 -> act -> fc2 | gated (gate/up fused, SiLU and product in one pass) |
| attention | every layer per frame | windows, whole frames in `fullatt_block_indexes` |

Parameter names are the checkpoint's (`visual.*` without the prefix), so a checkpoint loads as it
is but for the patch embedding's weight, flattened to a matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm
from mm_engine.models.layers.mlp import MLP
from mm_engine.models.layers.vision_layout import TowerLayout, rotary_tables, tower_layout

PATCH_WEIGHT = "patch_embed.proj.weight"


@dataclass(slots=True)
class TowerOutput:
    pooler_output: torch.Tensor  # [merged tokens, out hidden], image order
    deepstack_features: list[torch.Tensor] = field(default_factory=list)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with the residual add the blocks chain through (`RMSNorm.add_and_norm`)."""

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x.add_(delta)
        return x, self(x)


class FeedForward(nn.Module):
    """Qwen2-VL's MLP: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int, ops: TorchOps) -> None:
        super().__init__()
        self.heads, self.head_dim, self.ops = heads, dim // heads, ops
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments):
        tokens, h = x.shape[0], self.heads
        qkv = self.qkv(x).view(tokens, 3 * h, self.head_dim)
        qk = self.ops.rotary(qkv[:, : 2 * h], cos, sin)  # q and k heads side by side, one call
        out = self.ops.varlen_attention(qk[:, :h], qk[:, h:], qkv[:, 2 * h :], segments, self.head_dim**-0.5)
        return self.proj(out.view(tokens, -1))


class VisionBlock(nn.Module):
    def __init__(self, config, gated: bool, ops: TorchOps) -> None:
        super().__init__()
        dim = config.hidden_size if gated else config.embed_dim
        norm = (lambda: RMSNorm(dim, 1e-6, ops)) if gated else (lambda: LayerNorm(dim, eps=1e-6))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, config.num_heads, ops)
        if gated:
            self.mlp = MLP(config, bias=True, ops=ops)
        else:
            self.mlp = FeedForward(dim, int(dim * config.mlp_ratio), config.hidden_act)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, out: int, merge: int, gated: bool, ops: TorchOps) -> None:
        super().__init__()
        self.ln_q = RMSNorm(dim, 1e-6, ops) if gated else LayerNorm(dim, eps=1e-6)
        wide = dim * merge * merge
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, out))


class QwenVisionTower(nn.Module):
    """`forward(pixels, grids)`: the processor's flattened patches of every image of a step (its
    `pixel_values`, concatenated) and each image's (t, h, w) patch grid -> merged tokens."""

    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        self.gated = config.model_type == "qwen2_5_vl_vision"
        dim = config.hidden_size if self.gated else config.embed_dim
        out = config.out_hidden_size if self.gated else config.hidden_size
        self.merge = config.spatial_merge_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, dim, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config, self.gated, ops) for _ in range(config.depth))
        self.merger = PatchMerger(dim, out, self.merge, self.gated, ops)
        # Qwen2.5: every layer but the full-attention ones attends within windows of this many units.
        full = set(config.fullatt_block_indexes) if self.gated else set(range(config.depth))
        self.windowed = frozenset(range(config.depth)) - full
        self.window = config.window_size // config.patch_size // self.merge if self.gated else None
        self.head_dim = dim // config.num_heads
        self.theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    @staticmethod
    def checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tower weights as this module names them."""
        out = dict(state)
        if PATCH_WEIGHT in out:
            w = out[PATCH_WEIGHT]
            out[PATCH_WEIGHT] = w.reshape(w.shape[0], -1)
        return out

    def fuse(self) -> None:
        if self.gated:
            for block in self.blocks:
                block.mlp.fuse()

    def layout(self, grids: list[tuple[int, int, int]]) -> TowerLayout:
        return tower_layout(grids, self.merge, self.window if self.windowed else None)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> TowerOutput:
        layout = self.layout(grids)
        proj = self.patch_embed.proj
        x = proj(pixels.reshape(-1, proj.in_features).to(self.merger.ln_q.weight.dtype))  # norms stay nn
        if layout.order is not None:
            x = x[layout.order.to(x.device)]
        tables = rotary_tables(layout.positions, self.head_dim, self.theta)
        cos, sin = (t.to(x.device, x.dtype) for t in tables)
        h = self.blocks[0].norm1(x)
        for i, block in enumerate(self.blocks):
            segments = layout.windows if i in self.windowed else layout.frames
            x, h = block.norm2.add_and_norm(x, block.attn(h, cos, sin, segments))
            after = self.blocks[i + 1].norm1 if i + 1 < len(self.blocks) else self.merger.ln_q
            x, h = after.add_and_norm(x, block.mlp(h))
        merged = self.merger.mlp(h.view(-1, h.shape[-1] * self.merge**2))
        if layout.restore is not None:
            merged = merged[layout.restore.to(merged.device)]
        return TowerOutput(merged)
