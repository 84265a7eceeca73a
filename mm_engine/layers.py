"""The decoder-only language model (Llama, Mistral, Qwen2) over a paged KV cache.

Parameter names follow the Hugging Face checkpoints (`layers.N.self_attn.q_proj` and so on), so
loading is a rename of prefixes and nothing more. Whether a projection has a bias is read from the
checkpoint itself (Qwen2 has q/k/v biases, Llama may have `attention_bias`), not guessed per family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mm_engine.kernels import cpu_elementwise
from mm_engine.kernels.backend import AttentionBackend
from mm_engine.kernels.metadata import AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.c_kernels = False  # kernels/cpu_elementwise.py: one C pass instead of torch's five ops

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x += delta` in place (x is the residual stream, owned by the forward pass), then
        `(x, norm(x))`: the residual add and the next norm, one pass over each row in C."""
        if self.c_kernels:
            fused = cpu_elementwise.rms_norm(x, self.weight, self.eps, delta)
            if fused is not None:
                return fused
        x.add_(delta)
        return x, self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_kernels:
            fused = cpu_elementwise.rms_norm(x, self.weight, self.eps)
            if fused is not None:
                return fused[1]
        # torch's fused kernel: one pass and no temporaries instead of the pow/mean/rsqrt/mul
        # spelling, with bit-identical float32 output. Half inputs are normalised in float32 and
        # cast back before the weight, as the Hugging Face models do.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, `rotate_half` layout, any rope type transformers knows."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        rope_type = params.get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope type {rope_type!r} depends on sequence length and is not supported")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[tokens, 1, head_dim // 2]` for these positions (both halves of a head use
        the same angles), computed once per forward pass and shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`[tokens, heads, head_dim]`, rotate_half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    Written into halves of one output rather than as `x * cos + rotate_half(x) * sin`, which makes a
    negated copy and a concatenation first; the arithmetic, and so every bit, is the same."""
    cos, sin = rope
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)
    return out


class Attention(nn.Module):
    def __init__(self, config, head_dim: int, bias: dict[str, bool]) -> None:
        super().__init__()
        h, self.num_heads, self.num_kv_heads = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.head_dim = head_dim
        self.q_proj = nn.Linear(h, self.num_heads * head_dim, bias=bias["q_proj"])
        self.k_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias["k_proj"])
        self.v_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias["v_proj"])
        self.o_proj = nn.Linear(self.num_heads * head_dim, h, bias=bias["o_proj"])
        self.scale = head_dim**-0.5
        self.qkv_proj: nn.Linear | None = None
        self.c_kernels = False  # kernels/cpu_elementwise.py: rotary in place, in C

    def fuse(self) -> None:
        """One matmul for q, k and v instead of three (after loading, which uses the HF names):
        fewer, larger GEMMs, and the input is read once."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_proj = _concat_linears(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t, hd, h, kvh = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            # q and k sit side by side in the fused output: rotate them as one [t, h + kvh, hd] view
            # (in place in C: nothing else reads the projection's output).
            qk = qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd)
            if not (self.c_kernels and cpu_elementwise.rotary_(qk, *rope)):
                qk = apply_rotary(qk, rope)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * hd :]
        else:
            q = apply_rotary(self.q_proj(x).view(t, h, hd), rope)
            k = apply_rotary(self.k_proj(x).view(t, kvh, hd), rope)
            v = self.v_proj(x)
        v = v.reshape(t, kvh, hd)
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = ACT2FN[config.hidden_act]
        self.gate_up_proj: nn.Linear | None = None
        # A fused act(gate) * up over the fused projection's output, or None where it does not
        # apply (kernels/cpu_elementwise.py sets it on CPU); None: the two torch ops.
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            fused = self.act_and_mul(gate_up) if self.act_and_mul is not None else None
            if fused is not None:
                return self.down_proj(fused)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


def _concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (a missing bias is zero)."""
    w = parts[0].weight
    fused = nn.Linear(
        w.shape[1], sum(p.out_features for p in parts), bias=any(p.bias is not None for p in parts)
    )
    fused = fused.to(device=w.device, dtype=w.dtype).requires_grad_(False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(
                torch.cat([p.bias if p.bias is not None else w.new_zeros(p.out_features) for p in parts])
            )
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, bias: dict[str, bool]) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim, bias)
        self.mlp = MLP(config, bias["mlp"])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rope, k_cache, v_cache, meta, backend):
        """`x` is the previous layer's MLP output, still to be added to `residual` (None for the
        first layer: x is the embeddings). Returns this layer's (MLP output, residual): each add
        is left to the next norm, which does it in the same pass over the row."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        attn = self.self_attn(h, rope, k_cache, v_cache, meta, backend)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, attn)
        return self.mlp(h), residual


class DecoderLM(nn.Module):
    """Token embeddings, decoder layers, final norm and LM head. `forward` takes embeddings so that
    image features can be spliced in before the first layer; it uses them as the residual stream,
    so they are overwritten."""

    def __init__(self, config, bias: dict[str, bool], tie_embeddings: bool) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.head_dim = head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, head_dim, bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config, head_dim)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_lm_head = tie_embeddings
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, embeds, positions, kv_k, kv_v, meta: AttentionMetadata, backend: AttentionBackend):
        x, residual = embeds, None
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, kv_k[i], kv_v[i], meta, backend)
        return self.norm(x) if residual is None else self.norm.add_and_norm(residual, x)[1]

    def fuse_projections(self) -> None:
        """Call once the checkpoint is loaded: q/k/v and gate/up become single matmuls."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
