"""Gemma 4's vision tower on the engine's ops, and the embedder that projects its output.

An image arrives as its patches in row-major order (the processor's, padding dropped) and its
patch grid `(rows, columns)`; both sides are multiples of the pooling kernel `k`.
- Each patch (pixels in [0, 1], mapped to [-1, 1]) is projected without bias, plus a learned
  embedding of its column and one of its row (`position_embedding_table[0]`, `[1]`).
- Blocks as Gemma's decoder layers (four RMSNorms, GeGLU MLP), attention over each image in both
  directions, q, k and v RMS-normed per head (v without a weight), scale 1. The rotary is axial:
  the first half of a head turns with the column, the second with the row, each half as
  rotate_half; `rotate_part` reorders the dims so the ops' one rotate_half call does both.
- Linears may clamp their input and output (`use_clipped_linears`: bounds from the checkpoint).
- Every `k x k` patches are averaged (float32) into one token, scaled by sqrt(hidden) and, with
  `standardize`, shifted and scaled by `std_bias` / `std_scale`.
The embedder RMS-norms each token (no weight) and projects it to the language model's width.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm, rotate_part
from mm_engine.models.layers.gemma4 import rms
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.vision_layout import rotary_tables

F32 = torch.float32


class ClippedLinear(nn.Module):
    """`linear` (no bias), its input and output clamped to checkpoint bounds when `clipped`."""

    def __init__(self, n_in: int, n_out: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "output_min"):
                self.register_buffer(name, torch.tensor(-float("inf")))
            for name in ("input_max", "output_max"):
                self.register_buffer(name, torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        out = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(out, self.output_min, self.output_max)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        dim, self.heads, self.head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        if config.num_key_value_heads != self.heads:
            raise ValueError("Gemma 4 vision towers with grouped KV heads are not supported")
        clip, inner = config.use_clipped_linears, self.heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (ClippedLinear(dim, inner, clip) for _ in range(3))
        self.o_proj = ClippedLinear(inner, dim, clip)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.eps, self.ops = config.rms_norm_eps, ops
        quarter = self.head_dim // 4  # column half's pairs, then the row half's, as rotate_half pairs them
        ar = torch.arange(quarter)
        pairs = torch.cat([ar, ar + 2 * quarter, ar + quarter, ar + 3 * quarter])
        self.register_buffer("pairs", pairs, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments):
        t, h, hd = x.shape[0], self.heads, self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(t * h, hd)).view(t, h, hd)
        k = self.k_norm(self.k_proj(x).reshape(t * h, hd)).view(t, h, hd)
        qk = rotate_part(self.ops, torch.cat([q, k], 1), cos, sin, self.pairs)
        v = rms(self.v_proj(x).view(t, h, hd), self.eps)
        out = self.ops.varlen_attention(qk[:, :h], qk[:, h:], v, segments, 1.0)
        return self.o_proj(out.reshape(t, h * hd))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim, width, clip = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate_proj, self.up_proj = ClippedLinear(dim, width, clip), ClippedLinear(dim, width, clip)
        self.down_proj = ClippedLinear(width, dim, clip)
        self.act = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionBlock(nn.Module):
    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4VisionAttention(config, ops)
        self.mlp = Gemma4VisionMLP(config)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim, eps, ops), RMSNorm(dim, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, ops)

    def forward(self, x, cos, sin, segments: Segments) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, segments))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionTower(nn.Module):
    """`forward(patches, grids)`: every image's patches `[sum of rows x columns, 3 x patch^2]` and
    patch grids -> pooled tokens `[sum of tokens, hidden]`, float32 after the pooling as
    transformers keeps it. Parameter names are the checkpoint's (`vision_tower.*`)."""

    def __init__(self, config, ops: TorchOps) -> None:
        super().__init__()
        dim = config.hidden_size
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = nn.Linear(3 * config.patch_size**2, dim, bias=False)
        table = torch.zeros(2, config.position_embedding_size, dim)
        self.patch_embedder.position_embedding_table = nn.Parameter(table)
        self.encoder = nn.Module()
        depth = config.num_hidden_layers
        self.encoder.layers = nn.ModuleList(Gemma4VisionBlock(config, ops) for _ in range(depth))
        self.k = config.pooling_kernel_size
        self.theta = config.rope_parameters["rope_theta"]
        self.head_dim, self.dim = config.head_dim, dim
        self.standardize = config.standardize
        if self.standardize:
            self.register_buffer("std_bias", torch.zeros(dim))
            self.register_buffer("std_scale", torch.ones(dim))

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        proj = self.patch_embedder.input_proj
        table = self.patch_embedder.position_embedding_table
        cols = torch.cat([torch.arange(w).repeat(h) for h, w in grids]).to(table.device)
        rows = torch.cat([torch.arange(h).repeat_interleave(w) for h, w in grids]).to(table.device)
        x = proj((2 * (patches - 0.5)).to(table.dtype)) + table[0][cols] + table[1][rows]
        tables = rotary_tables(torch.stack([cols, rows], 1), self.head_dim, self.theta)
        cos, sin = (t.to(x.device, x.dtype) for t in tables)
        segments = Segments.of([h * w for h, w in grids])
        for block in self.encoder.layers:
            layer_boundary()
            x = block(x, cos, sin, segments)
        return self.pool(x, grids)

    def pool(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        k, out = self.k, []
        for image, (h, w) in zip(x.split([h * w for h, w in grids]), grids, strict=True):
            grid = image.float().view(h // k, k, w // k, k, -1)
            out.append(grid.mean(dim=(1, 3)).reshape(-1, grid.shape[-1]).to(x.dtype))
        pooled = torch.cat(out).float() * self.dim**0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class Gemma4Embedder(nn.Module):
    """`embed_vision`: RMS norm without weight, then `embedding_projection` to the LM's width."""

    def __init__(self, vision_dim: int, text_dim: int, eps: float, dtype: torch.dtype = F32) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(vision_dim, text_dim, bias=False, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms(x, self.eps))
