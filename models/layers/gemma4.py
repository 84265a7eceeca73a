"""Gemma 4's language model over the paged KV cache, with what it does beyond Gemma 3
(layers/gemma.py, whose embedding, MLP and norm placement it keeps):

- Norms multiply by `weight` itself; q and k are RMS-normed per head, v too (without a weight),
  and the attention scale is 1.
- Global (`full_attention`) layers have heads of their own size and KV head count (per-layer
  config); with `attention_k_eq_v` they have no v projection: the values are the keys' projection
  before the norm and rotary. Their rotary ("proportional") turns a quarter of the head.
- The last `num_kv_shared_layers` layers compute no keys or values: each reads the cache of the
  last earlier layer of its type. They own no KV memory (`kv_index`, `kv_layer_dims`).
- With `use_bidirectional_attention="vision"` an image's tokens see each other in both directions
  in the sliding layers only; global layers stay causal.
- Per-layer input embeddings (layers/per_layer_embed.py) and a learned `layer_scalar` per layer.
- The 26B-A4B: routed experts beside every layer's dense MLP (layers/gemma4_moe.py).
- `final_logit_softcapping`: logits become `cap * tanh(logits / cap)`.

With `tp`, Megatron's split as Gemma 3's; the per-layer embedding parts are whole on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mm_engine.kernels.backend import AttentionBackend
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.ops import TORCH_OPS, TorchOps
from mm_engine.models.layers.decoder import RMSNorm, Rotary
from mm_engine.models.layers.gemma import FULL, NORMS, SLIDING, GemmaMLP, add_norms, lm_head, scaled_embedding
from mm_engine.models.layers.gemma4_moe import Gemma4Experts, Gemma4Router
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.per_layer_embed import PerLayerEmbedding, PerLayerGate
from mm_engine.parallel.group import TPGroup

F32 = torch.float32


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight (Gemma 4's values), in float32 as transformers computes it."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def kv_sources(config) -> list[int]:
    """For each layer, the layer whose KV cache it reads: itself, or (a KV-sharing layer) the last
    layer of its type before the sharing ones."""
    n, shared, kinds = config.num_hidden_layers, config.num_kv_shared_layers or 0, config.layer_types
    first = n - shared
    last = {kind: i for i, kind in enumerate(kinds[:first])}
    missing = {kinds[i] for i in range(first, n)} - last.keys()
    if missing:
        raise ValueError(f"KV-sharing layers of type {sorted(missing)} have no earlier layer to read")
    return [i if i < first else last[kinds[i]] for i in range(n)]


def layer_dims(config, i: int) -> tuple[int, int]:
    """(KV heads, head size) of layer `i` before any tensor-parallel split."""
    layer = config.per_layer_config[i]
    return layer.num_key_value_heads, layer.head_dim


class Gemma4Attention(nn.Module):
    def __init__(
        self, config, i: int, ops: TorchOps, tp: TPGroup | None = None, dtype: torch.dtype = F32
    ) -> None:
        super().__init__()
        world = tp.world if tp is not None else 1
        kv_heads, hd = layer_dims(config, i)
        h = config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads // world, kv_heads // world
        self.head_dim = hd
        self.kind = config.layer_types[i]
        self.window = config.sliding_window if self.kind == SLIDING else None
        # Only the sliding layers see an image's tokens in both directions (transformers' mask).
        self.bidirectional = self.kind == SLIDING
        self.tp, self.ops, self.eps = tp, ops, config.rms_norm_eps
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(hd, self.eps, ops, dtype)
        self.k_proj = self.v_proj = self.k_norm = None
        if kv_sources(config)[i] == i:  # a layer that writes its own KV
            self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias, dtype=dtype)
            self.k_norm = RMSNorm(hd, self.eps, ops, dtype)
            if not (config.attention_k_eq_v and self.kind == FULL):
                self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias, dtype=dtype)

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t, h, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = self.ops.rotary(self.q_norm(self.q_proj(x).reshape(t * h, hd)).view(t, h, hd), *rope)
        if self.k_proj is not None:
            raw = self.k_proj(x).view(t, kvh, hd)
            k = self.ops.rotary(self.k_norm(raw.reshape(t * kvh, hd)).view(t, kvh, hd), *rope)
            v = rms(raw if self.v_proj is None else self.v_proj(x).view(t, kvh, hd), self.eps)
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k_cache, v_cache, meta, 1.0, window=self.window)
        out = self.o_proj(out.reshape(t, h * hd))
        return out if self.tp is None else self.tp.all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self, config, i: int, ops: TorchOps, tp: TPGroup | None = None, dtype: torch.dtype = F32
    ) -> None:
        super().__init__()
        self.self_attn = Gemma4Attention(config, i, ops, tp, dtype)
        shared = kv_sources(config)[i] != i
        width = config.intermediate_size * (2 if config.use_double_wide_mlp and shared else 1)
        self.mlp = GemmaMLP(config, tp, dtype, width=width)
        add_norms(self, NORMS, config, ops, dtype)
        self.per_layer = PerLayerGate(config, ops, dtype) if config.hidden_size_per_layer_input else None
        self.register_buffer("layer_scalar", torch.ones(1, dtype=dtype))
        self.moe = bool(getattr(config, "enable_moe_block", False))
        if self.moe:  # beside the dense MLP, on the same stream (layers/gemma4_moe.py)
            self.router = Gemma4Router(config, dtype)
            self.experts = Gemma4Experts(config, ops, tp, dtype)
            extra = (
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
            )
            add_norms(self, extra, config, ops, dtype)

    def forward(self, x, per_layer, rope, k_cache, v_cache, meta, backend):
        attn = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta, backend)
        x = x + self.post_attention_layernorm(attn)
        ffn = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            routed = self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))
            ffn = self.post_feedforward_layernorm_1(ffn) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(ffn)
        if self.per_layer is not None:
            x = self.per_layer(x, per_layer)
        return x * self.layer_scalar


class Gemma4LM(nn.Module):
    """Same interface as `layers.DecoderLM`, plus `reads_token_ids`: the per-layer embedding looks
    the step's tokens up (`forward(..., token_ids=, image_rows=)`; image rows read as the pad
    token, whatever id the runner left there). `pad_aliases`: token ids
    embedded as the pad token (Gemma 4's image, video and audio placeholders, wherever no
    encoder output replaces them: a generated one, say), as transformers embeds them."""

    def __init__(
        self, config, tie_embeddings: bool, ops: TorchOps = TORCH_OPS, tp: TPGroup | None = None,
        dtype: torch.dtype = F32, pad_aliases: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        super().__init__()
        if config.use_bidirectional_attention == "all":
            raise ValueError("Gemma 4 text models with use_bidirectional_attention='all' are not supported")
        world = tp.world if tp is not None else 1
        self.tp, self.vocab_size = tp, config.vocab_size
        self.head_dim = config.per_layer_config[0].head_dim
        self.embed_tokens = scaled_embedding(config, tp, dtype)
        self.register_buffer("pad_aliases", torch.tensor(pad_aliases, dtype=torch.long), persistent=False)
        self.pad_token_id = config.pad_token_id
        if pad_aliases:  # the runner looks tokens up itself: the embedding sees the aliased ids
            self.embed_tokens.register_forward_pre_hook(lambda _, args: (self.unalias(args[0]),))
        self.layer_types = list(config.layer_types)
        n = config.num_hidden_layers
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, ops, tp, dtype) for i in range(n))
        # Each layer's KV cache: the paged caches exist for the layers that write their own only.
        sources = kv_sources(config)
        owners = [i for i in range(n) if sources[i] == i]
        self.kv_index = [owners.index(sources[i]) for i in range(n)]
        self.num_kv_layers = len(owners)
        self.kv_layer_dims = [(layer_dims(config, i)[0] // world, layer_dims(config, i)[1]) for i in owners]
        self.per_layer = PerLayerEmbedding(config, ops, dtype) if config.hidden_size_per_layer_input else None
        self.reads_token_ids = self.per_layer is not None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.rotary = nn.ModuleDict(
            {
                kind: Rotary(config, config.per_layer_config[kind].head_dim, layer_type=kind)
                for kind in sorted(set(self.layer_types))
            }
        )
        self.softcap = config.final_logit_softcapping
        self.lm_head, self.tied_lm_head = lm_head(config, self.embed_tokens, tie_embeddings, tp, dtype)

    def forward(
        self, embeds, positions, kv_k, kv_v, meta: AttentionMetadata, backend: AttentionBackend,
        deepstack=None, token_ids: torch.Tensor | None = None, image_rows: torch.Tensor | None = None,
    ):  # fmt: skip
        x = embeds
        per_layer = None
        if self.per_layer is not None:
            if token_ids is None:
                raise ValueError("this model's per-layer embeddings need the step's token ids")
            ids = self.unalias(token_ids)
            if image_rows is not None:
                ids = ids.index_fill(0, image_rows, self.pad_token_id)
            per_layer = self.per_layer(ids, embeds)
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        causal = meta
        if meta.bidirectional is not None:  # global layers: no image ranges (same derived plans)
            causal = dataclasses.replace(meta, bidirectional=None)
        for i, layer in enumerate(self.layers):
            layer_boundary()
            j = self.kv_index[i]
            seen = meta if layer.self_attn.bidirectional else causal
            vector = None if per_layer is None else per_layer[:, i]
            x = layer(x, vector, ropes[self.layer_types[i]], kv_k[j], kv_v[j], seen, backend)
        return self.norm(x)

    def unalias(self, ids: torch.Tensor) -> torch.Tensor:
        if not len(self.pad_aliases):
            return ids
        return torch.where(torch.isin(ids, self.pad_aliases), self.pad_token_id, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[:, : self.vocab_size]  # the last share is padded
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
