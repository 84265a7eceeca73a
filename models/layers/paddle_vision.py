"""PaddleOCR-VL's vision tower and projector on the engine's layers and ops.

A NaViT-style SigLIP at the image's own resolution: every image's 14-px patches in raster order
(the processor's), packed into one sequence.
- The patch convolution is the matmul it is; the learned 27 x 27 position square is resized
  bilinearly (half-pixel centres, edges clamped) to each image's patch grid and added.
- SigLIP blocks (LayerNorm, attention with biases, tanh-GELU MLP) with a 2-D rotary: the first
  quarter of each head turns with the patch's row, the second with its column, as rotate_half
  pairs them (the Qwen towers' tables); attention within each image; a final LayerNorm.
- The projector LayerNorms each patch, puts every 2 x 2 patches side by side (row-major merge
  units, so the tokens come out in the Qwen towers' order) and maps them through Linear, GELU,
  Linear to the language model's width.

Parameter names are the checkpoint's (`visual.vision_model.*`, `projector.*`) with the three
attention projections fused into one `qkv` on load (`checkpoint_state`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.mlp import FeedForward
from mm_engine.models.layers.qwen_vision import TowerOutput
from mm_engine.models.layers.qwen_vision_parts import LayerNorm, VisionAttention
from mm_engine.models.layers.vision_layout import rotary_tables


class PaddleVisionBlock(nn.Module):
    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.norm1, self.norm2 = LayerNorm(dim, eps=eps), LayerNorm(dim, eps=eps)
        self.attn = VisionAttention(dim, config.num_attention_heads, ops)
        self.mlp = FeedForward(dim, config.intermediate_size, config.hidden_act, ("fc1", "fc2"), ops)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PaddleProjector(nn.Module):
    def __init__(self, dim: int, out: int, merge: int) -> None:
        super().__init__()
        self.merge, self.wide = merge, dim * merge * merge
        self.pre_norm = nn.LayerNorm(dim, eps=1e-5)
        self.linear_1, self.linear_2 = nn.Linear(self.wide, self.wide), nn.Linear(self.wide, out)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        m, units = self.merge, []
        for image, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids, strict=True):
            grid = self.pre_norm(image).view(t, h // m, m, w // m, m, -1).transpose(2, 3)
            units.append(grid.reshape(-1, self.wide))
        return self.linear_2(F.gelu(self.linear_1(torch.cat(units))))


class PaddleVisionTower(nn.Module):
    """`forward(pixels, grids)` as `QwenVisionTower`'s: the processor's patches `[patches, 3, 14,
    14]` of every image and their (t, h, w) grids -> merged tokens in the LM's width."""

    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        vc = config.vision_config
        dim, patch = vc.hidden_size, vc.num_channels * vc.patch_size**2
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(patch, dim)
        self.side = vc.image_size // vc.patch_size
        self.embeddings.position_embedding = nn.Embedding(self.side * self.side, dim)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(PaddleVisionBlock(vc, ops) for _ in range(vc.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(dim, eps=vc.layer_norm_eps)
        self.projector = PaddleProjector(dim, config.text_config.hidden_size, vc.spatial_merge_size)
        self.head_dim = dim // vc.num_attention_heads
        self.theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    @staticmethod
    def checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`vision_model.*` and `projector.*` as this module names them: the patch convolution's
        kernel flattened, q/k/v fused into `qkv`, SigLIP's block names as the Qwen blocks'; the
        pooling head and packing table transformers does not load either are dropped."""
        out, qkv = {}, {}
        for key, w in state.items():
            key = key.removeprefix("vision_model.")
            if key.startswith(("head.", "packing_position_embedding")):  # unused, as in transformers
                continue
            if key == "embeddings.patch_embedding.weight":
                w = w.reshape(w.shape[0], -1)
            parts = key.split(".")
            if (
                parts[0] == "encoder"
                and parts[3] == "self_attn"
                and parts[4] in ("q_proj", "k_proj", "v_proj")
            ):
                qkv.setdefault((".".join(parts[:3]), parts[5]), {})[parts[4]] = w
                continue
            key = key.replace(".self_attn.out_proj.", ".attn.proj.").replace(".layer_norm1.", ".norm1.")
            out[key.replace(".layer_norm2.", ".norm2.")] = w
        for (layer, kind), pieces in qkv.items():
            out[f"{layer}.attn.qkv.{kind}"] = torch.cat([pieces[p] for p in ("q_proj", "k_proj", "v_proj")])
        return out

    def fuse(self) -> None:
        pass  # q/k/v are one linear from the checkpoint on; the MLP has no gate to fuse

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> TowerOutput:
        proj = self.embeddings.patch_embedding
        dtype = self.post_layernorm.weight.dtype  # norms stay nn modules whatever packs the linears
        x = proj(pixels.reshape(-1, proj.in_features).to(dtype))
        x = x + self.grid_embeddings(grids).to(x.dtype)
        positions = torch.cat(
            [torch.cartesian_prod(torch.arange(h), torch.arange(w)).repeat(t, 1) for t, h, w in grids]
        )
        tables = rotary_tables(positions, self.head_dim, self.theta)
        cos, sin = (t.to(x.device, x.dtype) for t in tables)
        segments = Segments.of([h * w for t, h, w in grids for _ in range(t)])
        for block in self.encoder.layers:
            layer_boundary()
            x = block(x, cos, sin, segments)
        return TowerOutput(self.projector(self.post_layernorm(x), grids))

    def grid_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square resized bilinearly to each image's grid, raster order, float32."""
        table = self.embeddings.position_embedding.weight
        square = table.float().view(self.side, self.side, -1).permute(2, 0, 1)[None]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=False)
            out.append(grid[0].flatten(1).t().repeat(t, 1))
        return torch.cat(out)
