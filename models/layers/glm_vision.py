"""The GLM vision towers (GLM-4.1V, GLM-4.6V, GLM-OCR) on the engine's layers and ops.

A Qwen2.5-VL-style tower (models/layers/qwen_vision.py: the same packed patches, processor order,
2-D rotary and attention per frame, never windows) with GLM's pieces:
- the patch embedding has a bias; GLM-4.1V then RMS-norms each patch and adds a learned square
  grid of positions resampled bicubically to the image's grid (`grid_embeddings`);
- blocks are pre-RMSNorm attention and a gated MLP (GLM-OCR: biases, and an RMSNorm over each
  head of q and k);
- after a final RMSNorm, every `merge x merge` patches become one token through a strided
  convolution (`downsample`, loaded as the matmul it is), then a merger: a projection, LayerNorm,
  GELU, and a gated MLP.

Parameter names are the checkpoint's (`visual.*` without the prefix); only the two convolutions'
weights are reshaped to matrices on load.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.mlp import MLP
from mm_engine.models.layers.qwen_vision import TowerOutput
from mm_engine.models.layers.qwen_vision_parts import VisionAttention
from mm_engine.models.layers.vision_layout import rotary_tables, tower_layout


class GlmVisionBlock(nn.Module):
    def __init__(self, config, ops: TorchOps, ocr: bool) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.norm1, self.norm2 = RMSNorm(dim, eps, ops), RMSNorm(dim, eps, ops)
        bias = config.attention_bias
        self.attn = VisionAttention(dim, config.num_heads, ops, bias, bias and ocr, eps if ocr else None)
        width = config.intermediate_size if ocr else config.out_hidden_size
        self.mlp = MLP(config, bias=bias and ocr, ops=ops, width=width)


class GlmMerger(nn.Module):
    """`proj`, LayerNorm, GELU, then a gated MLP `context` wide (no biases but the norm's)."""

    def __init__(self, dim: int, context: int, act: str, ops: TorchOps) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        shape = SimpleNamespace(hidden_size=dim, intermediate_size=context, hidden_act=act)
        self.mlp = MLP(shape, bias=False, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(F.gelu(self.post_projection_norm(self.proj(x))))


class GlmVisionTower(nn.Module):
    """`forward(pixels, grids)` as `QwenVisionTower`'s: every image's flattened patches and (t, h, w)
    patch grids -> merged tokens. `ocr`: GLM-OCR's tower (no position grid, q/k norms, biases)."""

    def __init__(self, config, ops: TorchOps, ocr: bool = False) -> None:
        super().__init__()
        dim, out, eps = config.hidden_size, config.out_hidden_size, config.rms_norm_eps
        self.merge = merge = config.spatial_merge_size
        patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, dim)
        self.ocr = ocr
        if not ocr:
            self.post_conv_layernorm = RMSNorm(dim, eps, ops)
            self.embeddings = nn.Module()
            side = config.image_size // config.patch_size
            self.embeddings.position_embedding = nn.Embedding(side * side, dim)
        self.blocks = nn.ModuleList(GlmVisionBlock(config, ops, ocr) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(dim, eps, ops)
        self.downsample = nn.Linear(dim * merge * merge, out)
        context = out * config.in_channels if ocr else config.intermediate_size
        self.merger = GlmMerger(out, context, config.hidden_act, ops)
        self.head_dim = dim // config.num_heads
        self.theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    @staticmethod
    def checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tower weights as this module names them: the patch convolution's
        kernel flattened; the downsampling one's `[out, dim, m, m]` as a matmul over the merge
        unit's patches side by side (patch-major, as the processor orders them); the merger's
        gated MLP under `merger.mlp`."""
        out = {}
        for key, w in state.items():
            if key == "patch_embed.proj.weight":
                w = w.reshape(w.shape[0], -1)
            elif key == "downsample.weight":
                w = w.permute(0, 2, 3, 1).reshape(w.shape[0], -1)
            elif key.startswith("merger.") and key.split(".")[1] in ("gate_proj", "up_proj", "down_proj"):
                key = "merger.mlp." + key.removeprefix("merger.")
            out[key] = w
        return out

    def fuse(self) -> None:
        for block in self.blocks:
            block.mlp.fuse()
        self.merger.mlp.fuse()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> TowerOutput:
        layout = tower_layout(grids, self.merge)
        proj = self.patch_embed.proj
        dtype = self.post_layernorm.weight.dtype  # norms stay nn modules whatever packs the linears
        x = proj(pixels.reshape(-1, proj.in_features).to(dtype))
        if not self.ocr:
            x = self.post_conv_layernorm(x)
            x = x + self.grid_embeddings(grids, layout.positions).to(x.dtype)
        tables = rotary_tables(layout.positions, self.head_dim, self.theta)
        cos, sin = (t.to(x.device, x.dtype) for t in tables)
        h = self.blocks[0].norm1(x)
        for i, block in enumerate(self.blocks):
            layer_boundary()
            x, h = block.norm2.add_and_norm(x, block.attn(h, cos, sin, layout.frames))
            after = self.blocks[i + 1].norm1 if i + 1 < len(self.blocks) else self.post_layernorm
            x, h = after.add_and_norm(x, block.mlp(h))
        merged = self.downsample(h.reshape(-1, self.downsample.in_features))
        return TowerOutput(self.merger(merged))

    def grid_embeddings(self, grids: list[tuple[int, int, int]], positions: torch.Tensor) -> torch.Tensor:
        """GLM-4.1V's learned square grid of positions, sampled bicubically (half-pixel centres,
        edges clamped) at each patch's place in its own image's grid, in float32."""
        table = self.embeddings.position_embedding.weight
        side = int(table.shape[0] ** 0.5)
        square = table.float().view(side, side, -1).permute(2, 0, 1)[None]
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids]).float()
        where = (positions.float() + 0.5) / sizes * 2 - 1  # (row, column) in [-1, 1]
        grid = where.flip(-1)[None, :, None, :].to(table.device)  # grid_sample reads (x, y)
        sampled = F.grid_sample(square, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled[0, :, :, 0].t().to(table.dtype)
