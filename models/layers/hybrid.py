"""The hybrid language model of Qwen3.5: Gated DeltaNet (linear attention) layers interleaved with
gated full-attention layers (`config.layer_types`), over the paged KV cache and the state pool.

- A linear-attention layer (`GatedDeltaNet`) projects each token to q, k, v (through a causal
  depthwise conv), an output gate z, a write strength beta and a decay g, and runs the gated delta
  rule (kernels/gated_delta.py) from the sequence's slot in the state pool; it keeps no KV.
- A full-attention layer (`GatedAttention`) is Qwen3's attention with two changes: q_proj also
  yields a per-channel output gate (sigmoid), and the rotary turns only the first
  `partial_rotary_factor` of each head.
Qwen3.5's RMSNorms scale by `1 + weight`; the family adds the 1 to the stored weights on load, so
the norms here are the engine's plain ones (the gated norm inside a linear layer is not shifted).

Which rows of a step are decodes and which are prefill chunks is worked out once per step (the
first linear layer, `_layout`) and kept in the metadata for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mm_engine.kernels import cpu_layer_decode
from mm_engine.kernels import gated_delta as gd
from mm_engine.kernels.host_copy import to_device
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.ops import TORCH_OPS, TorchOps
from mm_engine.models.layers import layer_decode
from mm_engine.models.layers.decoder import DecoderLM, RMSNorm, rotate_part
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.models.layers.mlp import MLP, MMAP_BYTES, can_concat, concat_linears
from mm_engine.models.layers.moe import SparseMoE, is_sparse
from mm_engine.parallel.group import TPGroup

LINEAR = "linear_attention"


def is_hybrid(config) -> bool:
    return LINEAR in (getattr(config, "layer_types", None) or [])


@dataclass(slots=True)
class _Layout:
    """One step's sequences as the linear layers see them."""

    decode_rows: torch.Tensor | slice | None  # rows of the one-token sequences (a slice: side by side)
    decode_slots: torch.Tensor | None
    decode_fresh: torch.Tensor | None  # float [decodes]: 0 where a sequence starts here
    # (first row, tokens, slot, continues a state, snapshots: (tokens in, row) each)
    prefills: list[tuple[int, int, int, bool, list[tuple[int, int]]]]
    decode_snapshots: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, rows) copied after


def _layout(meta: AttentionMetadata) -> _Layout:
    cached = meta.derived.get("hybrid")
    if cached is not None:
        return cached
    slots = meta.state_slots_cpu
    if slots is None:
        raise ValueError("a hybrid model's forward needs each sequence's state slot")
    snapshots = meta.state_snapshots_cpu or [[]] * len(slots)
    rows, dslots, fresh, prefills, kept, row = [], [], [], [], [], 0
    for n, seq_len, slot, snaps in zip(meta.query_lens_cpu, meta.seq_lens_cpu, slots, snapshots, strict=True):
        if n == 1:
            rows.append(row)
            dslots.append(slot)
            fresh.append(0.0 if seq_len == 1 else 1.0)
            kept.extend((slot, dst) for _, dst in snaps)
        else:
            prefills.append((row, n, slot, seq_len > n, snaps))
        row += n
    dev = meta.slot_mapping.device
    out = _Layout(None, None, None, prefills)
    if rows:
        span = slice(rows[0], rows[0] + len(rows))
        side_by_side = rows == list(range(span.start, span.stop))  # then views, not gathers
        out.decode_rows = span if side_by_side else to_device(rows, torch.long, dev)
        out.decode_slots = to_device(dslots, torch.long, dev)
        out.decode_fresh = None if all(fresh) else to_device(fresh, torch.float32, dev)
    if kept:
        src, dst = zip(*kept, strict=True)
        out.decode_snapshots = (to_device(list(src), torch.long, dev), to_device(list(dst), torch.long, dev))
    meta.derived["hybrid"] = out
    return out


class GatedNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """With `tp`, this rank's share of the key and value heads: the conv's q, k and v channels, z,
    beta and the decay by heads (column-parallel), out_proj by its input (row-parallel)."""

    def __init__(
        self, config, ops: TorchOps = TORCH_OPS, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.ops, self.tp = ops, tp  # the decode step's kernel (C on the cpu backend)
        h, world = config.hidden_size, tp.world if tp is not None else 1
        self.key_heads = config.linear_num_key_heads // world
        self.heads = config.linear_num_value_heads // world
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.heads % self.key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        keys, values = self.key_heads * self.key_dim, self.heads * self.value_dim
        self.widths = [keys, keys, values]  # q, k, v in the conv's channels
        channels = 2 * keys + values
        self.in_proj_qkv = nn.Linear(h, channels, bias=False, dtype=dtype)
        self.in_proj_z = nn.Linear(h, values, bias=False, dtype=dtype)
        self.in_proj_b = nn.Linear(h, self.heads, bias=False, dtype=dtype)
        self.in_proj_a = nn.Linear(h, self.heads, bias=False, dtype=dtype)
        self.in_proj: nn.Linear | None = None
        k = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(
            channels, channels, k, groups=channels, bias=False, padding=k - 1, dtype=dtype
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.norm = GatedNorm(self.value_dim, config.rms_norm_eps, ops, dtype)
        self.out_proj = nn.Linear(values, h, bias=False, dtype=dtype)

    def fuse(self) -> None:
        """The four input projections as one matmul."""
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        if not can_concat(parts):
            return  # e.g. GPTQ act-order with an input order of each: four matmuls
        self.in_proj = concat_linears(parts)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def _project(self, x: torch.Tensor):
        """mixed (q | k | v before the conv), z, b and a: views into one matmul's output where fused."""
        if self.in_proj is not None:
            widths = [sum(self.widths), self.heads * self.value_dim, self.heads, self.heads]
            return self.in_proj(x).split(widths, -1)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _qkv(self, y: torch.Tensor):
        n = y.shape[0]
        q, k, v = y.split(self.widths, -1)
        return (
            q.reshape(n, self.key_heads, self.key_dim),
            k.reshape(n, self.key_heads, self.key_dim),
            v.reshape(n, self.heads, self.value_dim),
        )

    def _prefill(self, mixed, g, beta, weight, out, conv, recurrent, row, n, slot, continues, snaps) -> None:
        """One sequence's chunk, in pieces cut at its snapshot points: after each, the state so far
        is also written to that point's snapshot row."""
        conv_state = conv[slot] if continues else None
        state = recurrent[slot] if continues else None
        done = 0
        for upto, dst in [*snaps, (n, None)]:
            if upto > done:
                part = slice(row + done, row + upto)
                y, conv_state = gd.causal_conv(mixed[part], weight, conv_state)
                out[part], state = self.ops.delta_rule_chunked(*self._qkv(y), g[part], beta[part], state)
                done = upto
            if dst is not None:
                conv[dst], recurrent[dst] = conv_state, state
        conv[slot], recurrent[slot] = conv_state, state

    def forward(self, x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor, meta: AttentionMetadata):
        """`conv` `[slots, channels, kernel - 1]` and `recurrent` `[slots, heads, key_dim,
        value_dim]`: this layer's state pool tensors, updated in place for every sequence."""
        lay = _layout(meta)
        mixed, z, b, a = self._project(x)
        t, heads, dv = x.shape[0], self.heads, self.value_dim
        weight = self.conv1d.weight[:, 0]
        out = None
        if lay.decode_rows is not None:
            rows, slots = lay.decode_rows, lay.decode_slots
            if lay.decode_fresh is not None:  # a one-token prompt: nothing before it
                keep = lay.decode_fresh
                conv.index_copy_(0, slots, conv[slots] * keep.view(-1, 1, 1).to(conv.dtype))
                recurrent.index_copy_(0, slots, recurrent[slots] * keep.view(-1, 1, 1, 1))
            norm = self.norm
            w = gd.DeltaWeights(weight, self.A_log, self.dt_bias, norm.weight, norm.eps, self.key_heads)
            inputs = mixed[rows], z[rows], b[rows], a[rows]
            decoded = self.ops.gated_delta_decode_(conv, recurrent, slots, *inputs, w)
            if lay.decode_snapshots is not None:
                src, dst = lay.decode_snapshots
                conv.index_copy_(0, dst, conv.index_select(0, src))
                recurrent.index_copy_(0, dst, recurrent.index_select(0, src))
            if not lay.prefills:  # every row a decode, in order
                out = decoded
            else:
                out = x.new_empty(t, heads * dv)
                out[rows] = decoded
        if lay.prefills:
            out = x.new_empty(t, heads * dv) if out is None else out
            beta, g = gd.gates(b, a, self.A_log, self.dt_bias)
            raw = x.new_empty(t, heads, dv, dtype=torch.float32)
            for row, n, slot, continues, snaps in lay.prefills:
                self._prefill(mixed, g, beta, weight, raw, conv, recurrent, row, n, slot, continues, snaps)
                part = slice(row, row + n)
                normed = self.norm(raw[part].to(x.dtype).view(n * heads, dv), z[part].reshape(n * heads, dv))
                out[part] = normed.view(n, heads * dv)
        out = self.out_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)


class GatedAttention(nn.Module):
    """Full attention with an output gate and a partial rotary (see the module's docstring). With
    `tp`, this rank's heads: q_proj holds each head's query and gate side by side, so a split by
    rows is a split by heads, as for k and v; o_proj row-parallel."""

    def __init__(
        self, config, head_dim: int, ops: TorchOps = TORCH_OPS, tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__()
        h, bias, world = config.hidden_size, config.attention_bias, tp.world if tp is not None else 1
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads // world,
            config.num_key_value_heads // world,
            head_dim,
        )
        self.tp = tp
        self.q_proj = nn.Linear(h, self.num_heads * head_dim * 2, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * head_dim, h, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, ops, dtype)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, ops, dtype)
        self.qkv_proj: nn.Linear | None = None
        self.scale = head_dim**-0.5
        self.ops = ops

    def fuse(self) -> None:
        if not can_concat([self.q_proj, self.k_proj, self.v_proj]):
            return
        self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend):
        t, h, kvh, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qg, k, v = self.qkv_proj(x).split([2 * h * hd, kvh * hd, kvh * hd], -1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qg = qg.view(t, h, 2 * hd)
        gate = qg[..., hd:].reshape(t, h * hd)
        q = self.q_norm(qg[..., :hd].reshape(t * h, hd)).view(t, h, hd)
        k = self.k_norm(k.reshape(t * kvh, hd)).view(t, kvh, hd)
        q, k = rotate_part(self.ops, q, *rope), rotate_part(self.ops, k, *rope)
        backend.write_kv(k, v.reshape(t, kvh, hd), k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale).reshape(t, h * hd)
        out = self.o_proj(out * torch.sigmoid(gate))
        return out if self.tp is None else self.tp.all_reduce(out)


class HybridLayer(nn.Module):
    def __init__(
        self, config, i: int, head_dim: int, ops: TorchOps, tp: TPGroup | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.linear = config.layer_types[i] == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, ops, tp, dtype)
        else:
            self.self_attn = GatedAttention(config, head_dim, ops, tp, dtype)
        self.mlp = (
            SparseMoE(config, ops, tp, dtype) if is_sparse(config, i) else MLP(config, False, ops, tp, dtype)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        # C descriptions for one-call forms (models/layers/layer_decode.py, set after loading where
        # they apply): a linear layer's whole decode, and any layer's post-attention half.
        self.decode_spec: cpu_layer_decode.MmDeltaLayer | None = None
        self.mlp_spec: cpu_layer_decode.MmMlp | None = None

    def forward(self, x, residual, rope, caches: tuple[torch.Tensor, torch.Tensor], meta, backend):
        """As `DecoderLayer.forward`; `caches` is this layer's (K, V) or (conv, recurrent) state."""
        done = None if self.decode_spec is None else self._decode_in_c(x, residual, caches, meta)
        if done is not None:
            return done
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        if self.linear:
            mixed = self.linear_attn(h, *caches, meta)
        else:
            mixed = self.self_attn(h, rope, *caches, meta, backend)
        if self.mlp_spec is not None and (done := layer_decode.mlp_half(self, residual, mixed)) is not None:
            return done
        residual, h = self.post_attention_layernorm.add_and_norm(residual, mixed)
        return self.mlp(h), residual

    def _decode_in_c(self, x, residual, caches, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole layer in one C call, as its modules compute it, when every row of the step is
        a decode continuing its state, in order; else None (nothing done)."""
        lay = _layout(meta)
        rows = x.shape[0]
        if lay.prefills or lay.decode_fresh is not None or lay.decode_snapshots is not None:
            return None
        if lay.decode_rows != slice(0, rows) or rows * 2 * self.mlp.width * 4 >= MMAP_BYTES:
            return None  # (the MLP's rows in chunks past that: the modules' path, whose sums those are)
        conv, state = caches
        tensors = (x, conv, state) if residual is None else (x, conv, state, residual)
        if not all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors):
            return None
        lib, spec = self.linear_attn.ops.lib, self.decode_spec
        return cpu_layer_decode.delta_layer_decode(lib, spec, x, residual, conv, state, lay.decode_slots)


class HybridLM(DecoderLM):
    """`DecoderLM` with hybrid layers: full-attention layer j reads `kv_k[j]`, linear layer j the
    state pool's tensors `states.conv[j]`, `states.recurrent[j]`."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.cache_index: list[int] = []
        counts = {True: 0, False: 0}
        for layer in self.layers:
            self.cache_index.append(counts[layer.linear])
            counts[layer.linear] += 1
        self.num_kv_layers, self.num_linear_layers = counts[False], counts[True]

    def make_layer(self, config, i, head_dim, bias, ops, qk_norm, tp, dtype) -> nn.Module:
        return HybridLayer(config, i, head_dim, ops, tp, dtype)

    def forward(self, embeds, positions, kv_k, kv_v, meta, backend, deepstack=None, states=None):
        if deepstack is not None:
            raise ValueError("DeepStack features are not supported by the hybrid model")
        x, residual = embeds, None
        rope = self.rotary(positions, x.dtype)
        for layer, j in zip(self.layers, self.cache_index, strict=True):
            layer_boundary()
            caches = (states.conv[j], states.recurrent[j]) if layer.linear else (kv_k[j], kv_v[j])
            x, residual = layer(x, residual, rope, caches, meta, backend)
        return self.norm.add_and_norm(residual, x)[1]

    def fuse_projections(self) -> None:
        for layer in self.layers:
            (layer.linear_attn if layer.linear else layer.self_attn).fuse()
            layer.mlp.fuse()
