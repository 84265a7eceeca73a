"""The Qwen vision transformers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense and MoE) on the
engine's layers and ops.

All images of a step run as one packed sequence: the patch embedding (a 3-D convolution whose
stride is its kernel, so one matmul over flattened patches), blocks of pre-norm attention and
MLP, and the merger (every `merge x merge` patches -> one language-model token). Attention is one
call per layer over every segment of the step (`ops.varlen_attention`: whole frames, or Qwen2.5's
windows), never padded; the 2-D rotary turns q and k in place inside the fused QKV output; the
residual add and the next norm are one pass (`add_and_norm`). What differs between the versions:

| | Qwen2-VL | Qwen2.5-VL | Qwen3-VL, Qwen3.5 |
|---|---|---|---|
| norms | LayerNorm | RMSNorm | LayerNorm |
| MLP | fc1 -> act -> fc2 | gated (gate/up fused, SiLU and product in one pass) | as Qwen2 (tanh-GELU) |
| attention | every layer per frame | windows, whole frames in `fullatt_block_indexes` | per frame |
| positions | rotary | rotary | rotary + a learned grid resampled to the image |
| extras | | | Qwen3-VL: DeepStack features from a few blocks |

Parameter names are the checkpoint's (`visual.*` without the prefix), so a checkpoint loads as it
is but for the patch embedding's weight, flattened to a matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.qwen_vision_parts import PatchMerger, Qwen3Merger, VisionBlock
from mm_engine.models.layers.vision_layout import TowerLayout, rotary_tables, tower_layout

PATCH_WEIGHT = "patch_embed.proj.weight"
# The vision configs' model types, by the tower they describe.
VERSIONS = {
    "qwen2_vl_vision": "qwen2",
    "qwen2_5_vl_vision": "qwen2_5",
    "qwen3_vl_vision": "qwen3",
    "qwen3_vl_moe_vision": "qwen3",
    "qwen3_5_vision": "qwen3",
    "qwen3_5_moe_vision": "qwen3",
}


@dataclass(slots=True)
class TowerOutput:
    pooler_output: torch.Tensor  # [merged tokens, out hidden], image order
    deepstack_features: list[torch.Tensor] = field(default_factory=list)  # each as pooler_output


class QwenVisionTower(nn.Module):
    """`forward(pixels, grids)`: the processor's flattened patches of every image of a step (its
    `pixel_values`, concatenated) and each image's (t, h, w) patch grid -> merged tokens."""

    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        self.version = version = VERSIONS[config.model_type]
        dim = config.embed_dim if version == "qwen2" else config.hidden_size
        out = config.hidden_size if version == "qwen2" else config.out_hidden_size
        self.merge = merge = config.spatial_merge_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, dim, bias=version == "qwen3")
        self.blocks = nn.ModuleList(VisionBlock(config, version, ops) for _ in range(config.depth))
        self.deepstack_layers: tuple[int, ...] = ()
        if version == "qwen3":
            self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
            self.merger = Qwen3Merger(dim, out, merge, postshuffle=False)
            self.deepstack_layers = tuple(getattr(config, "deepstack_visual_indexes", None) or ())
            self.deepstack_merger_list = nn.ModuleList(
                Qwen3Merger(dim, out, merge, postshuffle=True) for _ in self.deepstack_layers
            )
        else:
            self.merger = PatchMerger(dim, out, merge, version == "qwen2_5", ops)
        # Qwen2.5: every layer but the full-attention ones attends within windows of this many units.
        full = set(config.fullatt_block_indexes) if version == "qwen2_5" else set(range(config.depth))
        self.windowed = frozenset(range(config.depth)) - full
        self.window = config.window_size // config.patch_size // merge if self.windowed else None
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
        if self.version == "qwen2_5":
            for block in self.blocks:
                block.mlp.fuse()

    def layout(self, grids: list[tuple[int, int, int]]) -> TowerLayout:
        return tower_layout(grids, self.merge, self.window)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> TowerOutput:
        layout = self.layout(grids)
        proj = self.patch_embed.proj
        dtype = self.blocks[0].norm1.weight.dtype  # norms stay nn modules whatever packs the linears
        x = proj(pixels.reshape(-1, proj.in_features).to(dtype))
        if self.version == "qwen3":
            x += self.grid_embeddings(grids, x.device).to(x.dtype)
        if layout.order is not None:
            x = x[layout.order.to(x.device)]
        tables = rotary_tables(layout.positions, self.head_dim, self.theta)
        cos, sin = (t.to(x.device, x.dtype) for t in tables)
        h = self.blocks[0].norm1(x)
        deepstack = []
        for i, block in enumerate(self.blocks):
            layer_boundary()
            segments = layout.windows if i in self.windowed else layout.frames
            x, h = block.norm2.add_and_norm(x, block.attn(h, cos, sin, segments))
            after = self.blocks[i + 1].norm1 if i + 1 < len(self.blocks) else self.merger.first_norm
            mlp = block.mlp(h)
            if i in self.deepstack_layers:  # a tap reads the block's output: add it before the tap
                x.add_(mlp)
                deepstack.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
                h = after(x)
            else:
                x, h = after.add_and_norm(x, mlp)
        merged = self.merger.project(h)
        if layout.restore is not None:
            merged = merged[layout.restore.to(merged.device)]
        return TowerOutput(merged, deepstack)

    def grid_embeddings(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """Qwen3's learned position grid (a square of `num_position_embeddings`) resampled
        bilinearly to each image's patch grid, corners aligned, in the processor's patch order."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        side = int(self.pos_embed.num_embeddings**0.5)
        index, weight = get_vision_interpolation_indices_and_weights(
            torch.tensor(grids), side, "bilinear", align_corners=True, spatial_merge_size=self.merge
        )
        taps = self.pos_embed(index.to(device))  # [patches, 4, dim]
        return (taps * weight.to(device, taps.dtype)[:, :, None]).sum(1)
