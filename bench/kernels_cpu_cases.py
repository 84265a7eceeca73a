"""bench.kernels_cpu's attention and K/V-write rows: the "cpu" backend (C kernels) against the
plain torch backend on the same pool and metadata, and a vision tower's attention against SDPA."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mm_engine.kernels.cpu_kernels import CpuKernels
from mm_engine.kernels.metadata import AttentionMetadata, Segments
from mm_engine.kernels.ops import CpuOps, TorchOps
from mm_engine.kernels.torch_backend import TorchBackend
from mm_engine.models.layers.vision_layout import tower_layout
from mm_engine.pools.kv_cache import paged_kv_tensor

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def _meta(seq_lens: list[int], q_lens: list[int]) -> tuple[AttentionMetadata, int]:
    """Metadata of one batch whose sequences own consecutive blocks; and the blocks needed."""
    tables, nxt = [], 0
    for n in seq_lens:
        tables.append(list(range(nxt, nxt + -(-n // BLOCK))))
        nxt += len(tables[-1])
    width = max(map(len, tables))
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.arange(sum(q_lens), dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    return meta, nxt


def attention_cases(
    kernels: CpuKernels, quick: bool, g: torch.Generator
) -> list[tuple[str, str, Callable, Callable]]:
    fast, plain = TorchBackend(kernels), TorchBackend()
    out = []
    grid = {
        "decode": [(16, 300), (64, 300)] if not quick else [(2, 40)],
        "prefill": [(4, 256, 256), (1, 1024, 512)] if not quick else [(1, 40, 20)],
    }
    for batch, length in grid["decode"]:
        meta, blocks = _meta([length] * batch, [1] * batch)
        k, v = (paged_kv_tensor(blocks, BLOCK, KV_HEADS, DIM, torch.float32, "cpu").normal_() for _ in "kv")
        q = torch.randn(batch, HEADS, DIM, generator=g)
        out.append((
            "decode", f"{batch} seqs x {length} tokens",
            lambda q=q, k=k, v=v, m=meta: (m.derived.clear(), fast.attend(q, k, v, m, 0.125)),
            lambda q=q, k=k, v=v, m=meta: (m.derived.clear(), plain.attend(q, k, v, m, 0.125)),
        ))  # fmt: skip
    for batch, length, new in grid["prefill"]:
        meta, blocks = _meta([length] * batch, [new] * batch)
        k, v = (paged_kv_tensor(blocks, BLOCK, KV_HEADS, DIM, torch.float32, "cpu").normal_() for _ in "kv")
        q = torch.randn(batch * new, HEADS, DIM, generator=g)
        what = "whole prompts" if new == length else f"chunks of {new} after {length - new}"
        out.append((
            "prefill", f"{batch} x {length} tokens, {what}",
            lambda q=q, k=k, v=v, m=meta: (m.derived.clear(), fast.attend(q, k, v, m, 0.125)),
            lambda q=q, k=k, v=v, m=meta: (m.derived.clear(), plain.attend(q, k, v, m, 0.125)),
        ))  # fmt: skip
    # Gemma 3's masks: a prefill chunk (after cached context) holding images whose tokens see each
    # other, and decodes beside it, all within a sliding window: one masked step's attention.
    length, new, window, image = (1024, 512, 256, 64) if not quick else (40, 20, 8, 4)
    meta, blocks = _meta([length, *[length] * 8], [new, *[1] * 8])
    pos = torch.arange(length - new, length)
    in_image = (pos % (4 * image)) < image  # an image every 4 * image positions
    lo = torch.where(in_image, pos - pos % (4 * image), 0)
    meta.bidirectional = (
        torch.cat([lo, torch.zeros(8, dtype=torch.long)]),
        torch.cat([torch.where(in_image, lo + image, 0), torch.zeros(8, dtype=torch.long)]),
    )
    k, v = (paged_kv_tensor(blocks, BLOCK, KV_HEADS, DIM, torch.float32, "cpu").normal_() for _ in "kv")
    q = torch.randn(new + 8, HEADS, DIM, generator=g)
    out.append((
        "prefill", f"masked: {new} new after {length - new}, images, window {window}, + 8 decodes",
        lambda q=q, k=k, v=v, m=meta: (m.derived.clear(), fast.attend(q, k, v, m, 0.125, window=window)),
        lambda q=q, k=k, v=v, m=meta: (m.derived.clear(), plain.attend(q, k, v, m, 0.125, window=window)),
    ))  # fmt: skip
    for tokens in (64, 2048) if not quick else (8,):
        meta, blocks = _meta([tokens], [tokens])
        k, v = (paged_kv_tensor(blocks + 1, BLOCK, KV_HEADS, DIM, torch.float32, "cpu").zero_() for _ in "kv")
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=g)
        key = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
        value = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
        slots = torch.randperm(blocks * BLOCK, generator=g)[:tokens]
        out.append((
            "kv_write", f"{tokens} tokens",
            lambda key=key, value=value, k=k, v=v, s=slots: fast.write_kv(key, value, k, v, s),
            lambda key=key, value=value, k=k, v=v, s=slots: plain.write_kv(key, value, k, v, s),
        ))  # fmt: skip
    images, tokens, heads = (8, 196, 12) if not quick else (2, 20, 2)
    # Views into one fused QKV output of packed images, as the engine's towers hand them over.
    q, k, v = torch.randn(images * tokens, 3, heads, DIM, generator=g).unbind(1)
    whole = Segments.of([tokens] * images)
    ops = CpuOps(kernels)
    out.append((
        "vision_attention", f"{images} images x {tokens} tokens x {heads} heads",
        lambda: ops.varlen_attention(q, k, v, whole, 0.125),
        lambda: TorchOps.varlen_attention(ops, q, k, v, whole, 0.125),
    ))  # fmt: skip
    # Qwen2.5-VL's windowed layers: 64-patch windows (edge windows smaller) of images 30 x 28 patches.
    for n in (1, 16) if not quick else (1,):
        windows = tower_layout([(1, 30, 28) if not quick else (1, 8, 12)] * n, 2, 4).windows
        wq, wk, wv = torch.randn(sum(windows.lens), 3, heads, DIM, generator=g).unbind(1)
        out.append((
            "vision_windows", f"{n} images, {len(windows.lens)} windows x {heads} heads",
            lambda q=wq, k=wk, v=wv, w=windows: ops.varlen_attention(q, k, v, w, 0.125),
            lambda q=wq, k=wk, v=wv, w=windows: TorchOps.varlen_attention(ops, q, k, v, w, 0.125),
        ))  # fmt: skip
    return out


Case = tuple[str, str, Callable, Callable]


def layer_decode_cases(kernels: CpuKernels, quick: bool, g: torch.Generator) -> list[Case]:
    """A Qwen3.5 linear-attention layer's decode (the benchmark model's widths; float32 panels): in
    one C call against its modules calling the same kernels one by one."""
    from types import SimpleNamespace

    from mm_engine.models.layers import layer_decode
    from mm_engine.models.layers.hybrid import LINEAR, HybridLayer, _Layout
    from mm_engine.models.layers.packed_linear import panel_linears

    hidden, inter, heads, dim = (64, 128, 2, 32) if quick else (1024, 3584, 16, 128)
    config = SimpleNamespace(
        hidden_size=hidden, intermediate_size=inter, hidden_act="silu", rms_norm_eps=1e-6,
        layer_types=[LINEAR], linear_num_key_heads=heads, linear_num_value_heads=heads,
        linear_key_head_dim=dim, linear_value_head_dim=dim, linear_conv_kernel_dim=4,
    )  # fmt: skip
    layer = HybridLayer(config, 0, dim, CpuOps(kernels), None, torch.float32).eval().requires_grad_(False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02, generator=g)
        layer.linear_attn.A_log.zero_()
    layer.linear_attn.fuse()
    layer.mlp.fuse()
    panel_linears(layer, kernels.lib)
    spec = layer_decode.delta_layer_spec(layer)
    assert spec is not None, "the bench's layer must be one the one-call decode describes"
    out = []
    for batch in (1, 4) if quick else (1, 8):
        channels = 2 * heads * dim + heads * dim
        conv, state = torch.zeros(batch, channels, 3), torch.zeros(batch, heads, dim, dim)
        slots = torch.arange(batch)
        meta = SimpleNamespace(derived={"hybrid": _Layout(slice(0, batch), slots, None, [])})
        x, residual = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)

        def run(with_spec: bool, x=x, residual=residual, caches=(conv, state), meta=meta):
            layer.decode_spec = spec if with_spec else None
            return layer(x, residual.normal_(generator=g), None, caches, meta, None)

        out.append((
            "layer_decode", f"Gated DeltaNet layer, {batch} seqs, hidden {hidden}",
            lambda run=run: run(True), lambda run=run: run(False),
        ))  # fmt: skip
    return out
