"""The CLIP and SigLIP vision transformers that LLaVA-style models read, on the engine's layers and
ops.

Every image of a step has the same patch grid, so the step is one packed sequence of `images x
tokens` rows: the patch embedding (a convolution whose stride is its kernel: one matmul over
flattened patches), the learned positions (and CLIP's class token and pre-norm), then pre-norm
blocks of attention and MLP. Attention is one call per layer (`ops.varlen_attention`, a segment
per image) on views into one fused QKV projection; the MLP's activation runs in place through the
ops. Only the blocks up to the deepest feature layer the model reads are kept, and the hidden
states of the feature layers are the output (what transformers returns as `hidden_states[i]`).

Parameter names are the checkpoint's (`vision_model.*` without the prefix), but for q/k/v, fused
into `qkv` on load (`fuse_qkv`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps

KINDS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}


def own_tower_kind(config) -> str | None:
    """The kind of tower ("clip", "siglip") where the engine has its own for this vision config."""
    return KINDS.get(getattr(config, "model_type", None))


class Embeddings(nn.Module):
    def __init__(self, config, kind: str) -> None:
        super().__init__()
        dim, patch = config.hidden_size, config.patch_size
        self.patch = patch
        self.grid = config.image_size // patch
        self.cls = kind == "clip"
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, patch, stride=patch, bias=not self.cls)
        positions = self.grid * self.grid + self.cls
        self.position_embedding = nn.Embedding(positions, dim)
        if self.cls:
            self.class_embedding = nn.Parameter(torch.zeros(dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, C, H, W] -> [images, tokens, dim]."""
        n, c, h, w = pixels.shape
        p, weight = self.patch, self.patch_embedding.weight
        if h != self.grid * p or w != self.grid * p:
            raise ValueError(f"the tower takes {self.grid * p}x{self.grid * p} pixels, got {h}x{w}")
        patches = pixels.reshape(n, c, self.grid, p, self.grid, p).permute(0, 2, 4, 1, 3, 5)
        x = patches.reshape(n, self.grid * self.grid, c * p * p) @ weight.reshape(weight.shape[0], -1).t()
        if self.patch_embedding.bias is not None:
            x = x + self.patch_embedding.bias
        if self.cls:
            x = torch.cat([self.class_embedding.expand(n, 1, -1).to(x.dtype), x], dim=1)
        return x + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, ops: TorchOps) -> None:
        super().__init__()
        self.heads, self.head_dim, self.ops = heads, dim // heads, ops
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        tokens, h = x.shape[0], self.heads
        qkv = self.qkv(x).view(tokens, 3 * h, self.head_dim)
        q, k, v = qkv[:, :h], qkv[:, h : 2 * h], qkv[:, 2 * h :]
        out = self.ops.varlen_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.out_proj(out.view(tokens, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, ops: TorchOps) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = ops.gelu_tanh if act == "gelu_pytorch_tanh" else ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.self_attn = Attention(dim, config.num_attention_heads, ops)
        self.mlp = MLP(dim, config.intermediate_size, config.hidden_act, ops)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), segments)
        return x + self.mlp(self.layer_norm2(x))


class VitTower(nn.Module):
    """`forward(pixels)`: [images, C, H, W] -> the hidden states of `feature_layers` (0: the
    embeddings, i: after block i), each [images, tokens, dim]."""

    def __init__(self, config, feature_layers: list[int], ops: TorchOps) -> None:
        super().__init__()
        self.kind = kind = KINDS[config.model_type]
        self.feature_layers = feature_layers
        self.embeddings = Embeddings(config, kind)
        if kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(Block(config, ops) for _ in range(max(feature_layers)))

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        x = self.embeddings(pixels)
        if self.kind == "clip":
            x = self.pre_layrnorm(x)
        n, tokens, dim = x.shape
        segments = Segments.of([tokens] * n)
        x = x.reshape(n * tokens, dim)
        states = {0: x}
        for i, block in enumerate(self.layers, start=1):
            x = block(x, segments)
            states[i] = x
        return [states[i].view(n, tokens, dim) for i in self.feature_layers]


def tower_state(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """A checkpoint's tower weights (`vision_model.` prefix already off) as `VitTower` names them:
    q/k/v fused into `qkv`, the blocks past `depth`, the post-norm and SigLIP's pooling head (which
    LLaVA never reads) left out."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key.startswith(("post_layernorm.", "head.")) or key.endswith("position_ids"):
            continue
        if key.startswith("encoder.layers."):
            layer = int(key.split(".")[2])
            if layer >= depth:
                continue
            key = key.removeprefix("encoder.")
        if ".self_attn." in key and key.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            continue  # fused below
        out[key] = tensor
    for layer in range(depth):
        at = f"encoder.layers.{layer}.self_attn."
        for part in ("weight", "bias"):
            out[f"layers.{layer}.self_attn.qkv.{part}"] = torch.cat(
                [state[f"{at}{name}.{part}"] for name in ("q_proj", "k_proj", "v_proj")]
            )
    return out
