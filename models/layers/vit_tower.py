"""The fixed-resolution vision transformers on the engine's layers and ops: CLIP and SigLIP (LLaVA,
Gemma 3), the SigLIP of Idefics3 / SmolVLM (NaViT-style positions, here on whole tiles) and
InternViT (InternVL).

Every image (or tile) of a step has the same patch grid, so the step is one packed sequence of
`images x tokens` rows: the patch embedding (a convolution whose stride is its kernel: one matmul
over flattened patches), the learned positions (and a class token, and CLIP's pre-norm), then
pre-norm blocks of attention and MLP. Attention is one call per layer (`ops.varlen_attention`, a
segment per image) on views into one fused QKV projection; the MLP's activation runs in place
through the ops. Only the blocks up to the deepest feature layer the model reads are kept, and the
hidden states of the feature layers are the output (what transformers returns as
`hidden_states[i]`), the last one through the tower's final norm where the family reads
`last_hidden_state`.

What differs between the towers (`VitSpec`):

| | CLIP | SigLIP, Idefics3 | InternViT |
|---|---|---|---|
| class token | yes | no | yes |
| patch bias | no | yes | yes |
| norms | LayerNorm (+ pre-norm) | LayerNorm | LayerNorm or RMSNorm |
| attention | | | optional RMSNorm over all of q and of k |
| layer scale | | | per channel, folded into the out projections on load |

Parameter names are SigLIP's (`vision_model.*` without the prefix) but for q/k/v, fused into `qkv`
on load; `tower_state` renames CLIP's and InternViT's checkpoints to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mm_engine.kernels.metadata import Segments
from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.mlp import FeedForward

KINDS = {
    "clip_vision_model": "clip",
    "siglip_vision_model": "siglip",
    "idefics3_vision": "navit",
    "smolvlm_vision": "navit",
    "internvl_vision": "internvit",
}


def own_tower_kind(config) -> str | None:
    """The kind of tower ("clip", "siglip", "navit", "internvit") where the engine has its own for
    this vision config."""
    return KINDS.get(getattr(config, "model_type", None))


def _side(value) -> int:
    """A square size from a config (InternVL writes `[h, w]`)."""
    if isinstance(value, int):
        return value
    h, w = value
    if h != w:
        raise ValueError(f"only square image and patch sizes are supported, got {list(value)}")
    return h


@dataclass(frozen=True, slots=True)
class VitSpec:
    kind: str
    class_token: bool
    patch_bias: bool
    rms: bool  # RMSNorm blocks (InternViT-6B) instead of LayerNorm
    qk_norm: bool
    qkv_bias: bool
    eps: float

    @classmethod
    def of(cls, config) -> VitSpec:
        kind = KINDS[config.model_type]
        if kind == "internvit":
            if not config.use_absolute_position_embeddings:
                raise ValueError("InternViT without absolute position embeddings is not supported")
            return cls(kind, True, True, config.norm_type == "rms_norm", config.use_qk_norm,
                       config.attention_bias, config.layer_norm_eps)  # fmt: skip
        return cls(kind, kind == "clip", kind != "clip", False, False, True, config.layer_norm_eps)


class Embeddings(nn.Module):
    def __init__(self, config, spec: VitSpec) -> None:
        super().__init__()
        dim, patch = config.hidden_size, _side(config.patch_size)
        self.patch, self.grid = patch, _side(config.image_size) // patch
        self.cls, self.navit = spec.class_token, spec.kind == "navit"
        self.patch_embedding = nn.Conv2d(config.num_channels, dim, patch, stride=patch, bias=spec.patch_bias)
        self.position_embedding = nn.Embedding(self.grid * self.grid + self.cls, dim)
        if self.cls:
            self.class_embedding = nn.Parameter(torch.zeros(dim))
        # NaViT's bucketed ids are the same for every whole tile: computed once, not per step.
        self.register_buffer("position_ids", self.positions(), persistent=False)

    def positions(self) -> torch.Tensor:
        """The position ids of a whole grid. Idefics3's are its NaViT buckets of the patch
        coordinates (computed as transformers does, so float rounding picks the same buckets)."""
        n = self.grid * self.grid + self.cls
        if not self.navit:
            return torch.arange(n)
        side = self.grid
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        step = 1.0 / torch.tensor([side])
        coords = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
        buckets = torch.bucketize(coords, boundaries, right=True)
        return (buckets[:, None] * side + buckets[None, :]).flatten()

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
        table = self.position_embedding.weight
        return x + (table if not self.navit else table[self.position_ids])


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, spec: VitSpec, ops: TorchOps) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dim, self.ops = heads, dim // heads, dim, ops
        self.qkv = nn.Linear(dim, 3 * dim, bias=spec.qkv_bias)
        self.out_proj = nn.Linear(dim, dim)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:  # over the whole projection, not per head; eps as transformers' default
            self.q_norm, self.k_norm = RMSNorm(dim, 1e-6, ops), RMSNorm(dim, 1e-6, ops)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        tokens, h, d = x.shape[0], self.heads, self.head_dim
        qkv = self.qkv(x)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, : self.dim]).view(tokens, h, d)
            k = self.k_norm(qkv[:, self.dim : 2 * self.dim]).view(tokens, h, d)
            v = qkv[:, 2 * self.dim :].view(tokens, h, d)
        else:
            qkv = qkv.view(tokens, 3 * h, d)
            q, k, v = qkv[:, :h], qkv[:, h : 2 * h], qkv[:, 2 * h :]
        out = self.ops.varlen_attention(q, k, v, segments, d**-0.5)
        return self.out_proj(out.view(tokens, -1))


class Block(nn.Module):
    def __init__(self, config, spec: VitSpec, ops: TorchOps) -> None:
        super().__init__()
        dim = config.hidden_size
        self.layer_norm1, self.layer_norm2 = (
            RMSNorm(dim, spec.eps, ops) if spec.rms else nn.LayerNorm(dim, eps=spec.eps) for _ in range(2)
        )
        self.self_attn = Attention(dim, config.num_attention_heads, spec, ops)
        self.mlp = FeedForward(dim, config.intermediate_size, config.hidden_act, ("fc1", "fc2"), ops)

    def forward(self, x: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), segments)
        return x + self.mlp(self.layer_norm2(x))


class VitTower(nn.Module):
    """`forward(pixels)`: [images, C, H, W] -> the hidden states of `feature_layers` (0: the
    embeddings, i: after block i), each [images, tokens, dim]. With `post_norm` the tower's final
    norm (`post_layernorm`) is applied to the last block's output, which must then be the one
    feature layer (transformers' `last_hidden_state`)."""

    def __init__(self, config, feature_layers: list[int], ops: TorchOps, post_norm: bool = False) -> None:
        super().__init__()
        self.spec = spec = VitSpec.of(config)
        self.feature_layers = feature_layers
        if post_norm and feature_layers != [config.num_hidden_layers]:
            raise ValueError(f"the final norm follows the last block only, not layers {feature_layers}")
        self.embeddings = Embeddings(config, spec)
        if spec.kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(Block(config, spec, ops) for _ in range(max(feature_layers)))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=spec.eps) if post_norm else None

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        x = self.embeddings(pixels)
        if self.spec.kind == "clip":
            x = self.pre_layrnorm(x)
        n, tokens, dim = x.shape
        segments = Segments.of([tokens] * n)
        x = x.reshape(n * tokens, dim)
        states = {0: x}
        for i, block in enumerate(self.layers, start=1):
            layer_boundary()
            x = block(x, segments)
            states[i] = x
        if self.post_layernorm is not None:
            states[len(self.layers)] = self.post_layernorm(x)
        return [states[i].view(n, tokens, dim) for i in self.feature_layers]


def tower_state(state: dict[str, torch.Tensor], depth: int, kind: str, post_norm: bool = False):
    """A checkpoint's tower weights (`vision_model.` prefix already off) as `VitTower` names them:
    q/k/v fused into `qkv`, the blocks past `depth` and SigLIP's pooling head (never read) left out,
    the final norm kept only with `post_norm`."""
    if kind == "internvit":
        state = _internvit_names(state)
    out: dict[str, torch.Tensor] = {}
    skip = ("head.", "embeddings.mask_token", *(() if post_norm else ("post_layernorm.",)))
    for key, tensor in state.items():
        if key.startswith(skip) or key.endswith("position_ids"):
            continue
        if key.startswith("encoder.layers."):
            if int(key.split(".")[2]) >= depth:
                continue
            key = key.removeprefix("encoder.")
        if ".self_attn." in key and key.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            continue  # fused below
        out[key] = tensor
    for layer in range(depth):
        at = f"encoder.layers.{layer}.self_attn."
        for part in ("weight", "bias"):
            if f"{at}q_proj.{part}" in state:
                out[f"layers.{layer}.self_attn.qkv.{part}"] = torch.cat(
                    [state[f"{at}{name}.{part}"] for name in ("q_proj", "k_proj", "v_proj")]
                )
    return out


INTERNVIT_NAMES = {
    "attention.projection_layer.": "self_attn.out_proj.",
    "attention.": "self_attn.",
    "layernorm_before.": "layer_norm1.",
    "layernorm_after.": "layer_norm2.",
}


def _internvit_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternViT's checkpoint in SigLIP's names. The layer scales multiply each block's attention
    and MLP outputs: folded into the out projection and fc2 (rows scaled)."""
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key == "embeddings.cls_token":
            out["embeddings.class_embedding"] = tensor.reshape(-1)
        elif key == "embeddings.position_embeddings":
            out["embeddings.position_embedding.weight"] = tensor[0]
        elif key.startswith("embeddings.patch_embeddings.projection."):
            out[key.replace("patch_embeddings.projection.", "patch_embedding.")] = tensor
        elif key.startswith("layernorm."):
            out[key.replace("layernorm.", "post_layernorm.")] = tensor
        elif key.startswith("encoder.layer."):
            layer, rest = key.removeprefix("encoder.layer.").split(".", 1)
            if rest in ("lambda_1", "lambda_2"):
                scales[f"{layer}.{rest}"] = tensor
                continue
            for old, new in INTERNVIT_NAMES.items():
                if rest.startswith(old):
                    rest = new + rest.removeprefix(old)
                    break
            out[f"encoder.layers.{layer}.{rest}"] = tensor
        else:
            out[key] = tensor
    for name, scale in scales.items():
        layer, which = name.split(".")
        target = f"encoder.layers.{layer}." + ("self_attn.out_proj." if which == "lambda_1" else "mlp.fc2.")
        out[target + "weight"] = out[target + "weight"] * scale[:, None]
        out[target + "bias"] = out[target + "bias"] * scale
    return out
