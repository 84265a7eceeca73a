"""The C prefill kernel (kernels/cpu_prefill.c), on every ISA variant this CPU runs: every prefill
chunk of a step in one call, causal over cached context plus the chunk, straight from the pool;
and a vision tower's attention over packed images through the same kernel. Each is held to SDPA
over the sequence's (or image's) own keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.attention import fill_pool, make_meta
from mm_engine.kernels import cpu_prefill
from mm_engine.kernels.ops import CpuOps
from mm_engine.kernels.torch_backend import TorchBackend
from mm_engine.pools.kv_cache import paged_kv_tensor


def _reference(q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) tokens of a sequence over all its keys, in float64."""
    m, n = q.shape[0], k.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[n - m :]
    out = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1) for t in (q, k, v)), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1).float()


@pytest.mark.parametrize(
    ("heads", "kvh", "d", "bs"),
    [
        (9, 3, 64, 16),
        (4, 4, 128, 8),
        (8, 1, 64, 16),
        (6, 2, 80, 32),
        (12, 2, 96, 16),
        (4, 2, 256, 16),
        (4, 1, 32, 4),
        (64, 1, 16, 16),
    ],
)
def test_prefill_kernel_matches_causal_attention_over_each_sequence(heads, kvh, d, bs, cpu_kernels):
    """Whole prompts (one longer than a tile), chunks after cached context, a one-token prompt and
    decodes in one step; unused slots hold NaN; head sizes from 16 to 256 (64, 80, 96, 128 and 256
    as real checkpoints have them), groups from 1 to 64."""
    g = torch.Generator().manual_seed(4)
    seq_lens, q_lens = [70, 37, 50, 1, 9, 20, 33], [70, 37, 5, 1, 1, 1, 33]
    tables, nxt = [], 1  # block 0 is never used: it stays NaN
    for n in seq_lens:
        tables.append(list(range(nxt, nxt + -(-n // bs))))
        nxt += len(tables[-1])
    k_cache = paged_kv_tensor(nxt, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
    v_cache = paged_kv_tensor(nxt, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
    keys, values = fill_pool(k_cache, v_cache, seq_lens, tables, g)
    meta = make_meta(seq_lens, q_lens, tables)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    out = TorchBackend(cpu_kernels).attend(q, k_cache, v_cache, meta, scale=d**-0.5)
    start = 0
    for k, v, m in zip(keys, values, q_lens, strict=True):
        want = _reference(q[start : start + m], k, v, d**-0.5)
        torch.testing.assert_close(out[start : start + m], want, rtol=1e-4, atol=1e-5)
        start += m


def test_prefill_kernel_reads_queries_through_their_strides_and_writes_only_its_rows(cpu_lib):
    """Queries as the model hands them over (a view into the fused q/k output, rows wider than the
    heads); rows of sequences not passed to the kernel are left as they were."""
    g = torch.Generator().manual_seed(5)
    heads, kvh, d, bs = 4, 2, 32, 16
    k_cache = paged_kv_tensor(4, bs, kvh, d, torch.float32, "cpu")
    v_cache = paged_kv_tensor(4, bs, kvh, d, torch.float32, "cpu")
    keys, values = fill_pool(k_cache, v_cache, [20, 12], [[0, 1], [2]], g)
    qk = torch.randn(32, heads + kvh, d, generator=g)
    q = qk[:, :heads]
    out = torch.full((32, heads, d), 7.0)
    got = cpu_prefill.paged_prefill(
        cpu_lib, q, k_cache, v_cache, torch.tensor([[2, 0]]), [20], [12], [12], d**-0.5, out=out
    )
    assert got is out
    torch.testing.assert_close(
        out[20:], _reference(q[20:], keys[1], values[1], d**-0.5), rtol=1e-4, atol=1e-5
    )
    assert bool((out[:20] == 7.0).all())


def test_prefill_kernel_declines_what_it_cannot_take(cpu_kernels):
    """Not float32, a head size that is no multiple of 16 (on every variant alike), or a
    mismatched `out`: None, and the backend's torch path answers instead."""
    lib = cpu_kernels.lib
    g = torch.Generator().manual_seed(6)
    cache = paged_kv_tensor(2, 4, 1, 8, torch.float32, "cpu")
    fill_pool(cache, cache, [5], [[0, 1]], g)
    q = torch.randn(5, 2, 8, generator=g)
    args = (torch.tensor([[0, 1]]), [0], [5], [5], 1.0)
    assert cpu_prefill.paged_prefill(lib, q, cache, cache, *args) is None  # head size 8
    wide = paged_kv_tensor(2, 4, 1, 16, torch.float32, "cpu").zero_()
    assert cpu_prefill.paged_prefill(lib, torch.randn(5, 2, 16).double(), wide, wide, *args) is None
    short = torch.empty(4, 2, 16)
    assert cpu_prefill.paged_prefill(lib, torch.randn(5, 2, 16), wide, wide, *args, out=short) is None
    meta = make_meta([5], [5], [[0, 1]])
    want = TorchBackend().attend(q, cache, cache, meta, scale=1.0)
    torch.testing.assert_close(TorchBackend(cpu_kernels).attend(q, cache, cache, meta, scale=1.0), want)


def test_engine_routes_the_vision_tower_through_the_kernel_only_where_it_is_enabled(siglip_qwen2):
    """By default the measured table decides; with the kernel enabled the engine's own SigLIP
    tower's attention goes through it, and the features are the same."""
    from mm_engine import LLM
    from mm_engine.kernels.ops import TORCH_OPS

    kw = {"kv_cache_memory_bytes": 4 * 1024**2}
    default = LLM(siglip_qwen2, **kw).engine.core
    ops = default.model.vision_tower.layers[0].self_attn.ops
    assert ops.c_vision == default.platform.kernels.uses("vision_attention")
    fast = LLM(siglip_qwen2, cpu_kernels="all", **kw).engine.core  # the engine argument, not the environment
    plain = LLM(siglip_qwen2, attention_backend="torch", **kw).engine.core
    assert all(layer.self_attn.ops.c_vision for layer in fast.model.vision_tower.layers)
    assert all(layer.self_attn.ops is TORCH_OPS for layer in plain.model.vision_tower.layers)
    size = fast.hf_config.vision_config.image_size
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(8))
    want = plain.model.encode_images(pixels)
    torch.testing.assert_close(fast.model.encode_images(pixels), want, rtol=1e-3, atol=5e-5)


@pytest.mark.parametrize("windows", [False, True])
def test_varlen_attention_over_packed_segments_matches_sdpa_per_segment(cpu_kernels, windows):
    """A vision tower's packed attention: q, k, v are views into one [tokens, 3 * heads, dim] QKV
    output, segments of any lengths (one row, a multiple of 16, a few odd ones) tile the rows, and
    each row sees exactly its own segment. The kernel and the torch twin both match SDPA run one
    segment at a time."""
    from mm_engine.kernels.metadata import Segments
    from mm_engine.kernels.ops import TORCH_OPS

    g = torch.Generator().manual_seed(11)
    heads, d = 3, 32
    segments = Segments.of([64, 1, 37, 16, 100, 5], windows=windows)
    qkv = torch.randn(sum(segments.lens), 3 * heads, d, generator=g)
    q, k, v = qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    per_segment = [
        F.scaled_dot_product_attention(*(x[s : s + n].transpose(0, 1) for x in (q, k, v)), scale=0.3)
        for s, n in zip(segments.starts, segments.lens, strict=True)
    ]
    want = torch.cat(per_segment, dim=1).transpose(0, 1)
    out = cpu_prefill.varlen(cpu_kernels.lib, q, k, v, segments.starts, segments.lens, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        CpuOps(cpu_kernels).varlen_attention(q, k, v, segments, 0.3), want, rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(TORCH_OPS.varlen_attention(q, k, v, segments, 0.3), want, rtol=1e-5, atol=1e-6)
    assert cpu_prefill.varlen(cpu_kernels.lib, q.double(), k, v, segments.starts, segments.lens, 0.3) is None


def test_page_sized_image_attention_runs_on_sdpa(cpu_kernels, monkeypatch):
    """An image of `LONG_SEGMENT` rows or more (an OCR page) is not sent to the C kernel, which
    lost to SDPA there; the batch's answer is still SDPA's per image."""
    from mm_engine.kernels import ops as ops_module
    from mm_engine.kernels.metadata import Segments

    ops = CpuOps(cpu_kernels)
    ops.c_vision = True
    called = []
    monkeypatch.setattr(cpu_prefill, "varlen", lambda *args: called.append(args))
    g = torch.Generator().manual_seed(12)
    segments = Segments.of([ops_module.LONG_SEGMENT, 7])
    q, k, v = torch.randn(3, sum(segments.lens), 2, 8, generator=g)
    out = ops.varlen_attention(q, k, v, segments, 0.5)
    assert called == []
    torch.testing.assert_close(out, ops_module.TORCH_OPS.varlen_attention(q, k, v, segments, 0.5))
    ops.varlen_attention(q[-7:], k[-7:], v[-7:], Segments.of([7]), 0.5)  # a short image still goes to C
    assert len(called) == 1
