"""The Pixtral vision transformer (Mistral 3, and LightOnOCR later) on the engine's layers and ops.

Images keep their own sizes (multiples of the patch), so a step is one packed sequence of every
image's patches, row by row: the patch embedding (one matmul over flattened patches), an RMSNorm,
then pre-norm blocks of attention and gated MLP. Positions are a 2-D rotary over (row, column) of
each patch in its image: Pixtral's even frequencies turn with the row, its odd ones with the column.
Attention is one call per layer (`ops.varlen_attention`, a segment per image) on views into one
fused QKV projection, q and k turned in place; the residual adds chain through the norms
(`add_and_norm`). The hidden states of the feature layers are the output (transformers'
`hidden_states[i]`: 0 after `ln_pre`, i after block i).

Parameter names are the checkpoint's (`vision_tower.*` without the prefix) but for q/k/v, fused
into `qkv` on load (`pixtral_state`), `o_proj`, named `proj` as in the Qwen towers whose attention
module this one shares, and the patch convolution, flattened to a matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.mlp import MLP
from mm_engine.models.layers.qwen_vision_parts import VisionAttention


def pixtral_rotary(grids: list[tuple[int, int]], head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """cos, sin `[patches, 1, head_dim // 2]` (float32) for images of `grids` patches (rows,
    columns), packed row by row."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rows, cols = inv_freq[0::2], inv_freq[1::2]
    angles = []
    for h, w in grids:
        r = torch.arange(h, dtype=torch.float).repeat_interleave(w)
        c = torch.arange(w, dtype=torch.float).repeat(h)
        angles.append(torch.cat([r[:, None] * rows, c[:, None] * cols], dim=1))
    table = torch.cat(angles)
    return table.cos()[:, None, :], table.sin()[:, None, :]


class Block(nn.Module):
    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        dim = config.hidden_size
        self.attention_norm, self.ffn_norm = RMSNorm(dim, 1e-5, ops), RMSNorm(dim, 1e-5, ops)
        self.attention = VisionAttention(dim, config.num_attention_heads, ops, bias=False)
        self.feed_forward = MLP(config, bias=False, ops=ops)


class PixtralTower(nn.Module):
    """`forward(images)`: each image `[C, H, W]` (H, W multiples of the patch) -> the hidden states
    of `feature_layers`, each `[patches of all images, dim]`."""

    def __init__(self, config, feature_layers: list[int], ops: TorchOps) -> None:
        super().__init__()
        dim, heads = config.hidden_size, config.num_attention_heads
        if getattr(config, "head_dim", None) not in (None, dim // heads):
            raise ValueError(f"Pixtral's head_dim {config.head_dim} is not {dim} / {heads}")
        params = config.rope_parameters or {}
        if params.get("rope_type", "axial") != "axial":
            raise ValueError(f"Pixtral's rotary must be axial, got {params.get('rope_type')!r}")
        self.theta = params.get("rope_theta", 10000.0)
        self.patch, self.head_dim = config.patch_size, dim // heads
        self.feature_layers = feature_layers
        self.patch_conv = nn.Linear(config.num_channels * self.patch**2, dim, bias=False)
        self.ln_pre = RMSNorm(dim, 1e-5, ops)
        self.layers = nn.ModuleList(Block(config, ops) for _ in range(max(feature_layers)))

    def fuse(self) -> None:
        for block in self.layers:
            block.feed_forward.fuse()

    def patches(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Every image's patches, row by row, flattened as the convolution reads them."""
        p, rows, grids = self.patch, [], []
        for image in images:
            c, height, width = image.shape
            h, w = height // p, width // p
            if h * p != height or w * p != width:
                raise ValueError(f"image sides must be multiples of the patch ({p}), got {height}x{width}")
            rows.append(image.reshape(c, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, c * p * p))
            grids.append((h, w))
        return torch.cat(rows), grids

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        pixels, grids = self.patches(images)
        x = self.ln_pre(self.patch_conv(pixels.to(self.ln_pre.weight.dtype)))  # norms are never packed
        cos, sin = (t.to(x.device, x.dtype) for t in pixtral_rotary(grids, self.head_dim, self.theta))
        segments = Segments.of([h * w for h, w in grids])
        states = {0: x}
        for i, block in enumerate(self.layers, start=1):
            layer_boundary()
            x = x + block.attention(block.attention_norm(x), cos, sin, segments)
            x = x + block.feed_forward(block.ffn_norm(x))
            states[i] = x
        return [states[i] for i in self.feature_layers]


def pixtral_state(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """A checkpoint's Pixtral weights as `PixtralTower` names them: q/k/v fused, o_proj as proj,
    the blocks past `depth` left out, the patch convolution flattened."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.startswith("transformer.layers."):
            layer = int(key.split(".")[2])
            if layer >= depth or key.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
                continue
            key = key.removeprefix("transformer.").replace(".attention.o_proj.", ".attention.proj.")
        elif key == "patch_conv.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
        out[key] = tensor
    for layer in range(depth):
        at = f"transformer.layers.{layer}.attention."
        out[f"layers.{layer}.attention.qkv.weight"] = torch.cat(
            [state[f"{at}{name}.weight"] for name in ("q_proj", "k_proj", "v_proj")]
        )
    return out
