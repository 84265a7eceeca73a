"""The decoder-only language model (Llama, Mistral, Qwen2/3, Qwen3's MoE) over a paged KV cache.

Parameter names follow the Hugging Face checkpoints (`layers.N.self_attn.q_proj` and so on), so
loading is a rename of prefixes and nothing more. Whether a projection has a bias is read from the
checkpoint itself (Qwen2 has q/k/v biases, Llama may have `attention_bias`), not guessed per family.

Every parameter is made in the `dtype` each constructor is given (nothing reads torch's
process-wide default dtype); the rotary frequencies are float32 whatever it is.

Norms, rotary and the MLP's activation go through the `ops` the platform hands the model
(kernels/ops.py: torch, or one ISA variant's C kernels on CPU); the layers never ask which.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mm_engine.kernels.backend import AttentionBackend
from mm_engine.kernels.cpu_layer_decode import MmAttnLayer, MmMlp
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.ops import TORCH_OPS, TorchOps
from mm_engine.models.layers import layer_decode
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.mlp import MLP, can_concat, concat_linears
from mm_engine.models.layers.moe import SparseMoE, is_sparse
from mm_engine.parallel.group import TPGroup


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, ops: TorchOps = TORCH_OPS, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps, self.ops = eps, ops

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x += delta` in place (x is the residual stream, owned by the forward pass), then
        `(x, norm(x))`: the residual add and the next norm, one pass over each row in C."""
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding, `rotate_half` layout, any rope type transformers knows.

    With `mrope_streams` (the Qwen VL line), positions are `[3, tokens]` (temporal, height, width)
    and frequency `k` of each head turns with the position of axis `mrope_streams[k]`."""

    def __init__(
        self, config, head_dim: int, mrope_streams: list[int] | None = None, layer_type: str | None = None
    ) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        if layer_type is not None:  # Gemma 3: one set of parameters per layer type
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope type {rope_type!r} depends on sequence length and is not supported")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
            self.scaling = 1.0
        else:
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        if mrope_streams is not None and len(mrope_streams) != inv_freq.numel():
            raise ValueError(
                f"mrope_section covers {len(mrope_streams)} frequencies, the head has {inv_freq.numel()}"
            )
        streams = None if mrope_streams is None else torch.tensor(mrope_streams, dtype=torch.long)
        self.register_buffer("streams", streams, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, 1, head_dim // 2]` for these positions (both halves of a head use
        the same angles), computed once per forward pass and shared by every layer."""
        if positions.dim() == 2:  # [3, tokens]: each frequency reads its own axis
            # (contiguous, as the C rotary takes it: the transposed gather would stay strided)
            freqs = positions[self.streams].t().float().contiguous() * self.inv_freq[None, :]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def rotate_part(ops: TorchOps, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs=None):
    """`x` `[tokens, heads, head_dim]` with the rotary over its first `2 * cos.shape[-1]` dims
    (a partial rotary leaves the rest as they are). `pairs`: a head's dims in the order that
    puts each pair an interleaved rotary turns together (GLM's: 0 with 1, 2 with 3, ...) half a
    rotary apart, where the rotate_half ops expect them. q and k get the same reordering, so
    their dot products, the only thing attention reads of them, are unchanged."""
    if pairs is not None:
        x = x[..., pairs]
    turned = 2 * cos.shape[-1]
    if turned == x.shape[-1]:
        return ops.rotary(x, cos, sin)
    return torch.cat([ops.rotary(x[..., :turned].contiguous(), cos, sin), x[..., turned:]], -1)


def interleaved_pairs(head_dim: int, turned: int) -> torch.Tensor:
    """The dim order for `rotate_part` that turns an interleaved rotary over the first `turned`
    dims of a head into the rotate_half layout: even dims, then odd ones, then the rest."""
    return torch.cat([torch.arange(0, turned, 2), torch.arange(1, turned, 2), torch.arange(turned, head_dim)])


def mrope_streams(section: list[int], interleaved: bool) -> list[int]:
    """Which position axis each rotary frequency reads: contiguous sections (Qwen2-VL, Qwen2.5-VL:
    t...t h...h w...w) or interleaved ones (Qwen3-VL: t h w t h w ..., then t for the rest)."""
    if not interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    out = [0] * sum(section)
    for axis in (1, 2):
        for k in range(axis, min(3 * section[axis], len(out)), 3):
            out[k] = axis
    return out


class Attention(nn.Module):
    """With `tp`, this rank's share of the heads (q, k and v split by heads, column-parallel) and
    of o_proj's input (row-parallel: the ranks' outputs are summed)."""

    def __init__(
        self, config, head_dim: int, bias: dict[str, bool], ops: TorchOps = TORCH_OPS, qk_norm: bool = False,
        tp: TPGroup | None = None, dtype: torch.dtype = torch.float32, pairs: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """`pairs`: an interleaved rotary's dim order (`interleaved_pairs`); None: rotate_half."""
        super().__init__()
        world = tp.world if tp is not None else 1
        h, self.num_heads, self.num_kv_heads = (
            config.hidden_size,
            config.num_attention_heads // world,
            config.num_key_value_heads // world,
        )
        self.tp = tp
        self.head_dim = head_dim
        self.q_proj = nn.Linear(h, self.num_heads * head_dim, bias=bias["q_proj"], dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias["k_proj"], dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias["v_proj"], dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * head_dim, h, bias=bias["o_proj"], dtype=dtype)
        self.scale = head_dim**-0.5
        self.qkv_proj: nn.Linear | None = None
        self.ops = ops
        # Qwen3: an RMSNorm over each head of q and k before the rotary.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, ops, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, ops, dtype) if qk_norm else None
        self.register_buffer("pairs", pairs, persistent=False)

    def fuse(self) -> None:
        """One matmul for q, k and v instead of three (after loading, which uses the HF names):
        fewer, larger GEMMs, and the input is read once."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if not can_concat(parts):
            return  # e.g. GPTQ act-order with an input order of each: three matmuls
        self.qkv_proj = concat_linears(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rotate_part(self.ops, x, *rope, self.pairs)

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t, hd, h, kvh = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        if self.q_norm is not None and self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            q = self.q_norm(qkv[:, : h * hd].reshape(t * h, hd)).view(t, h, hd)
            k = self.k_norm(qkv[:, h * hd : (h + kvh) * hd].reshape(t * kvh, hd)).view(t, kvh, hd)
            q, k, v = self._rotate(q, rope), self._rotate(k, rope), qkv[:, (h + kvh) * hd :]
        elif self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            # q and k sit side by side in the fused output: rotate them as one [t, h + kvh, hd] view
            # (in place where the ops can: nothing else reads the projection's output).
            qk = self._rotate(qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd), rope)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * hd :]
        else:
            q, k = self.q_proj(x).view(t, h, hd), self.k_proj(x).view(t, kvh, hd)
            if self.q_norm is not None:
                q = self.q_norm(q.reshape(t * h, hd)).view(t, h, hd)
                k = self.k_norm(k.reshape(t * kvh, hd)).view(t, kvh, hd)
            q, k, v = self._rotate(q, rope), self._rotate(k, rope), self.v_proj(x)
        v = v.reshape(t, kvh, hd)
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        out = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self, config, head_dim: int, bias: dict[str, bool], ops: TorchOps = TORCH_OPS, qk_norm: bool = False,
        tp: TPGroup | None = None, dtype: torch.dtype = torch.float32, sparse: bool = False,
        sandwich: bool = False, pairs: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """`sparse`: a mixture of experts (moe.py) in place of the MLP. `sandwich`: GLM's norms
        after attention and after the MLP too, each before its residual add. `pairs`: Attention's."""
        super().__init__()
        self.self_attn = Attention(config, head_dim, bias, ops, qk_norm, tp, dtype, pairs)
        self.mlp = SparseMoE(config, ops, tp, dtype) if sparse else MLP(config, bias["mlp"], ops, tp, dtype)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(dim, eps, ops, dtype)
        self.post_self_attn_layernorm = RMSNorm(dim, eps, ops, dtype) if sandwich else None
        self.post_mlp_layernorm = RMSNorm(dim, eps, ops, dtype) if sandwich else None
        # C descriptions for one-call forms (models/layers/layer_decode.py, set after loading where
        # they apply): the whole layer's decode, and the post-attention half.
        self.decode_spec: MmAttnLayer | None = None
        self.mlp_spec: MmMlp | None = None

    def forward(self, x, residual, rope, k_cache, v_cache, meta, backend):
        """`x` is the previous layer's MLP output, still to be added to `residual` (None for the
        first layer: x is the embeddings). Returns this layer's (MLP output, residual): each add
        is left to the next norm, which does it in the same pass over the row."""
        if self.decode_spec is not None:
            done = layer_decode.attention_layer(self, x, residual, rope, k_cache, v_cache, meta, backend)
            if done is not None:
                return done
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        attn = self.self_attn(h, rope, k_cache, v_cache, meta, backend)
        if self.mlp_spec is not None and (done := layer_decode.mlp_half(self, residual, attn)) is not None:
            return done
        if self.post_self_attn_layernorm is not None:
            attn = self.post_self_attn_layernorm(attn)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, attn)
        out = self.mlp(h)
        return (out if self.post_mlp_layernorm is None else self.post_mlp_layernorm(out)), residual


class DecoderLM(nn.Module):
    """Token embeddings, decoder layers, final norm and LM head. `forward` takes embeddings so that
    image features can be spliced in before the first layer; it uses them as the residual stream,
    so they are overwritten. `mrope_streams` and `qk_norm` are the Qwen VL line's (see Rotary,
    Attention). With `tp` every layer holds this rank's shard, and the embedding and the LM head
    its share of the vocabulary (`embed_tokens` sums the ranks' lookups, `logits` gathers them)."""

    def __init__(
        self,
        config,
        bias: dict[str, bool],
        tie_embeddings: bool,
        ops: TorchOps = TORCH_OPS,
        mrope_streams: list[int] | None = None,
        qk_norm: bool = False,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.head_dim = head_dim
        self.tp = tp
        self.vocab_size = config.vocab_size
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dtype)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, head_dim, bias, ops, qk_norm, tp, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.num_kv_layers = len(self.layers)  # layers with a paged KV cache
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.rotary = Rotary(config, self.rotary_dim(config, head_dim), mrope_streams)
        vocab = config.vocab_size if tp is None else self.embed_tokens.weight.shape[0]
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype)
        self.tied_lm_head = tie_embeddings
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, config, i: int, head_dim: int, bias, ops, qk_norm, tp, dtype) -> nn.Module:
        return DecoderLayer(config, head_dim, bias, ops, qk_norm, tp, dtype, is_sparse(config, i))

    @staticmethod
    def rotary_dim(config, head_dim: int) -> int:
        """How many of a head's dimensions the rotary turns: all, or `partial_rotary_factor` of
        them (Qwen3.5, GLM)."""
        params = getattr(config, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        return int(head_dim * factor)

    def forward(
        self, embeds, positions, kv_k, kv_v, meta: AttentionMetadata, backend: AttentionBackend,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):  # fmt: skip
        """`positions`: `[tokens]`, or `[3, tokens]` with M-RoPE. `deepstack`: (rows, features
        `[rows, layers, hidden]`), added to the output of the first layers at those rows."""
        x, residual = embeds, None
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            layer_boundary()
            x, residual = layer(x, residual, rope, kv_k[i], kv_v[i], meta, backend)
            if deepstack is not None and i < deepstack[1].shape[1]:
                rows, feats = deepstack
                residual.add_(x)  # the layer's whole output, as transformers forms it, then the extra
                residual[rows] += feats[:, i].to(x.dtype)
                x, residual = residual, None
        return self.norm(x) if residual is None else self.norm.add_and_norm(residual, x)[1]

    def fuse_projections(self) -> None:
        """Call once the checkpoint is loaded: q/k/v and gate/up become single matmuls."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.vocab_size]  # the last share is padded


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (padded to equal shares, so the LM head's logits gather
    evenly); a token outside them contributes zeros, and the ranks' lookups are summed. `scale`:
    a factor every embedding is multiplied by (Gemma's sqrt(hidden))."""

    def __init__(
        self, num: int, dim: int, tp: TPGroup, scale: float | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num, dim, tp
        self.start, self.end = tp.shard(num)
        self.weight = nn.Parameter(torch.empty(-(-num // tp.world), dim, dtype=dtype))
        scale_t = None if scale is None else torch.tensor(scale, dtype=dtype)
        self.register_buffer("embed_scale", scale_t, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        out = nn.functional.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        if self.embed_scale is not None:  # as Gemma's own: the factor in the weights' dtype
            out.mul_(self.embed_scale.to(out.dtype))
        return self.tp.all_reduce(out)
