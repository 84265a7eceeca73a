"""Gemma 3's language model over the paged KV cache: the same attention backends as `layers.py`,
with what Gemma does differently.

- Embeddings are scaled by sqrt(hidden) (image embeddings spliced in afterwards are not).
- RMSNorms multiply by `1 + weight`; after loading, `fuse_projections` stores `1 + weight` once,
  so the ops' plain `x * rsqrt(...) * weight` computes the same thing.
- Four norms per layer: before and after attention, before and after the MLP; the residual adds
  follow the post-norms.
- q and k are RMS-normed per head; the attention scale is `query_pre_attn_scalar ** -0.5`.
- Local layers attend within a sliding window with their own rotary base; global layers attend to
  everything (both, during prefill, also bidirectionally within an image: `AttentionMetadata`).
- The MLP is GeGLU (tanh GELU of the gate times the up projection).

With `tp`, the same Megatron split as `layers.py`: each rank its share of the heads and of the MLP
width (o_proj and down summed over the ranks), of the vocabulary for the embedding and the head.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.backend import AttentionBackend
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.ops import TORCH_OPS, TorchOps
from mm_engine.models.layers.decoder import RMSNorm, Rotary, VocabParallelEmbedding
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.parallel.group import TPGroup

FULL, SLIDING = "full_attention", "sliding_attention"
F32 = torch.float32


class ScaledEmbedding(nn.Embedding):
    def __init__(self, num: int, dim: int, scale: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(num, dim, dtype=dtype)
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def scaled_embedding(config, tp: TPGroup | None, dtype: torch.dtype) -> nn.Module:
    """The token embedding times sqrt(hidden) (this rank's vocabulary rows under `tp`)."""
    scale = config.hidden_size**0.5
    if tp is None:
        return ScaledEmbedding(config.vocab_size, config.hidden_size, scale, dtype)
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, scale, dtype)


def lm_head(
    config, embed: nn.Module, tie: bool, tp: TPGroup | None, dtype: torch.dtype
) -> tuple[nn.Linear, bool]:
    """The head over the embedding's rows (padded to the ranks' equal shares), its weight the
    embedding's own when `tie`; and whether it is tied."""
    vocab = config.vocab_size if tp is None else embed.weight.shape[0]
    head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype)
    if tie:
        head.weight = embed.weight
    return head, tie


class GemmaAttention(nn.Module):
    def __init__(
        self, config, layer_type: str, ops: TorchOps, tp: TPGroup | None = None, dtype: torch.dtype = F32
    ) -> None:
        super().__init__()
        h, hd, world = config.hidden_size, config.head_dim, tp.world if tp is not None else 1
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads // world,
            config.num_key_value_heads // world,
            hd,
        )
        self.tp = tp
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, ops, dtype)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, ops, dtype)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.layer_type = layer_type
        self.window = config.sliding_window if layer_type == SLIDING else None
        self.ops = ops

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t, h, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(t * h, hd)).view(t, h, hd)
        k = self.k_norm(self.k_proj(x).reshape(t * kvh, hd)).view(t, kvh, hd)
        q, k = self.ops.rotary(q, *rope), self.ops.rotary(k, *rope)
        v = self.v_proj(x).view(t, kvh, hd)
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale, window=self.window)
        out = self.o_proj(out.reshape(t, h * hd))
        return out if self.tp is None else self.tp.all_reduce(out)


class GemmaMLP(nn.Module):
    def __init__(
        self, config, tp: TPGroup | None = None, dtype: torch.dtype = F32, width: int | None = None
    ) -> None:
        super().__init__()
        width = (width or config.intermediate_size) // (tp.world if tp is not None else 1)
        self.tp = tp
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False, dtype=dtype)
        self.act = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out if self.tp is None else self.tp.all_reduce(out)


NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def add_norms(layer: nn.Module, names: tuple[str, ...], config, ops: TorchOps, dtype: torch.dtype) -> None:
    """RMSNorms over the hidden size under `names` (a Gemma layer's four, and Gemma 4's MoE three)."""
    for name in names:
        setattr(layer, name, RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_type: str, ops: TorchOps, tp: TPGroup | None = None, dtype: torch.dtype = F32
    ) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_type, ops, tp, dtype)
        self.mlp = GemmaMLP(config, tp, dtype)
        add_norms(self, NORMS, config, ops, dtype)

    def forward(self, x, rope, k_cache, v_cache, meta, backend):
        attn = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta, backend)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaLM(nn.Module):
    """Same interface as `layers.DecoderLM`: `embed_tokens`, `forward(embeds, positions, ...)`,
    `logits`, `head_dim`, `layers`."""

    def __init__(
        self, config, tie_embeddings: bool, ops: TorchOps = TORCH_OPS, tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 text models with bidirectional attention are not supported")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, cap, None):
                raise ValueError(f"{cap} is not supported")
        self.head_dim = config.head_dim
        self.tp, self.vocab_size = tp, config.vocab_size
        self.embed_tokens = scaled_embedding(config, tp, dtype)
        self.layer_types = list(config.layer_types)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, kind, ops, tp, dtype) for kind in self.layer_types
        )
        self.num_kv_layers = len(self.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.rotary = nn.ModuleDict(
            {kind: Rotary(config, config.head_dim, layer_type=kind) for kind in sorted(set(self.layer_types))}
        )
        self.lm_head, self.tied_lm_head = lm_head(config, self.embed_tokens, tie_embeddings, tp, dtype)

    def forward(
        self, embeds, positions, kv_k, kv_v, meta: AttentionMetadata, backend: AttentionBackend,
        deepstack=None,
    ):  # fmt: skip
        x = embeds
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            layer_boundary()
            x = layer(x, ropes[self.layer_types[i]], kv_k[i], kv_v[i], meta, backend)
        return self.norm(x)

    def fuse_projections(self) -> None:
        """After loading: every Gemma norm multiplies by 1 + weight; store that once."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.vocab_size]  # the last share is padded
