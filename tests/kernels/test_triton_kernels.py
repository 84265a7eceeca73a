"""Triton paged-attention and KV-write kernels, run by the Triton interpreter on CPU tensors, or
compiled on a GPU with MM_ENGINE_TEST_DEVICE=cuda (tests/conftest.py).

Every case compares against the plain reference below (gather K/V through the block table, repeat
K/V heads for GQA, masked softmax in float64 on the CPU), never against another backend under test.
"""

import dataclasses
import random
from functools import cache

import pytest
import torch
import triton
import triton.language as tl

from helpers.device import TEST_DEVICE
from mm_engine.kernels.backend import get_backend
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.triton_attention import paged_attention
from mm_engine.kernels.triton_backend import TritonBackend, choose_num_splits
from mm_engine.kernels.triton_kv_write import write_kv

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1.5e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1e-2),
}


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query and caches; each sequence's blocks are drawn from both pools in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    # Blocks [0, half) play the image pool and [half, 2 * half) the text pool; either could hold all.
    half = sum(blocks_per_seq) + 3
    image_pool, text_pool = list(range(half)), list(range(half, 2 * half))
    rng.shuffle(image_pool)
    rng.shuffle(text_pool)
    tables = []
    for n in blocks_per_seq:
        n_image = rng.randint(0, n)
        blocks = [image_pool.pop() for _ in range(n_image)] + [text_pool.pop() for _ in range(n - n_image)]
        rng.shuffle(blocks)
        tables.append(blocks)
    width = max(blocks_per_seq) + 2  # padded past the longest, as the engine pads
    block_tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    for i, blocks in enumerate(tables):
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    shape = (2 * half, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = []
    for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        for pos in range(c, c + q):
            slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    return query.to(TEST_DEVICE), k_cache.to(TEST_DEVICE), v_cache.to(TEST_DEVICE), on_device(meta)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata's tensors moved to the test device (host lists stay)."""
    moved = {
        name: getattr(meta, name).to(TEST_DEVICE)
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
    }
    return dataclasses.replace(meta, **moved)


def reference_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    tables = meta.block_tables.cpu()
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        pos = torch.arange(seq_len)
        blocks = tables[i, pos // block_size].long()
        # Gather on the cache's device (a GPU cache can be gigabytes), compute on the CPU in float64.
        k = k_cache[blocks.to(k_cache.device), (pos % block_size).to(k_cache.device)]
        v = v_cache[blocks.to(v_cache.device), (pos % block_size).to(v_cache.device)]
        k = k.cpu().double().repeat_interleave(group, dim=1)  # [seq, heads, d]
        v = v.cpu().double().repeat_interleave(group, dim=1)
        q = query[start : start + q_len].cpu().double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = seq_len - q_len + torch.arange(q_len)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out.float()


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.device.type == TEST_DEVICE.type
    torch.testing.assert_close(out.float().cpu(), ref, **TOL[dtype])


@triton.jit
def _bf16_dot_probe(x_ptr, out_ptr):
    idx = tl.arange(0, 16)
    x = tl.load(x_ptr + idx[:, None] * 16 + idx[None, :])
    tl.store(out_ptr + idx[:, None] * 16 + idx[None, :], tl.dot(x, x))


@cache
def interpreter_bf16_dot_works() -> bool:
    """Triton 3.8's interpreter stores bfloat16 as uint16 and multiplies those integers in tl.dot."""
    x = torch.ones((16, 16), dtype=torch.bfloat16, device=TEST_DEVICE)
    out = torch.empty((16, 16), dtype=torch.float32, device=TEST_DEVICE)
    _bf16_dot_probe[(1,)](x, out)
    return bool((out == 16).all())


def skip_unsupported(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not interpreter_bf16_dot_works():
        pytest.skip("the Triton interpreter computes bfloat16 tl.dot on the raw bits")


# (dtype, num_kv_heads, GQA ratio, head_dim, block_size): not the full cross product; each value of
# each axis appears, and each dtype meets several shapes.
CASES = [
    (torch.float32, 2, 1, 64, 16),
    (torch.float32, 1, 4, 80, 32),
    (torch.float32, 1, 8, 128, 16),
    (torch.float16, 2, 4, 64, 32),
    (torch.float16, 1, 8, 80, 16),
    (torch.float16, 2, 1, 128, 32),
    (torch.bfloat16, 1, 4, 128, 16),
    (torch.bfloat16, 2, 1, 80, 32),
]
# Mixed batch: decodes with no, short and long context, prefill chunks with and without context;
# most sequence lengths fall mid-block, so last blocks are partial.
QUERY_LENS = [1, 64, 1, 23, 1, 7]
CONTEXT_LENS = [0, 37, 300, 0, 129, 250]


@pytest.mark.parametrize(("dtype", "num_kv_heads", "group", "head_dim", "block_size"), CASES)
def test_mixed_batch_matches_reference(dtype, num_kv_heads, group, head_dim, block_size) -> None:
    skip_unsupported(dtype)
    query, k_cache, v_cache, meta = make_batch(
        QUERY_LENS, CONTEXT_LENS, block_size, num_kv_heads * group, num_kv_heads, head_dim, dtype
    )
    scale = head_dim**-0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale, num_splits=1)
    check(out, reference_attention(query, k_cache, v_cache, meta, scale), dtype)


# The edges of what the kernel takes: head sizes 32 to 256 (non-powers of two padded), block sizes
# 8 to 128, GQA groups that are not powers of two, a sequence that fits inside one block.
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size"),
    [
        (torch.float32, 2, 32, 8),
        (torch.float16, 3, 96, 128),
        (torch.float32, 1, 256, 64),
        (torch.float16, 6, 192, 8),
    ],
)
def test_edge_shapes(dtype, group, head_dim, block_size) -> None:
    query, k_cache, v_cache, meta = make_batch(
        [5, 1, 40], [0, 3, 150], block_size, 2 * group, 2, head_dim, dtype, seed=1
    )
    out = paged_attention(query, k_cache, v_cache, meta, 0.1, num_splits=1)
    check(out, reference_attention(query, k_cache, v_cache, meta, 0.1), dtype)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    num_seqs = rng.randint(2, 6)
    num_kv_heads = rng.choice([1, 2])
    query_lens = [1 if rng.random() < 0.5 else rng.randint(2, 64) for _ in range(num_seqs)]
    context_lens = [rng.randint(0, 300) for _ in range(num_seqs)]
    group = rng.choice([1, 4, 8])
    head_dim = rng.choice([64, 80, 128])
    dtype = rng.choice([torch.float32, torch.float16])
    query, k_cache, v_cache, meta = make_batch(
        query_lens,
        context_lens,
        rng.choice([16, 32]),
        group * num_kv_heads,
        num_kv_heads,
        head_dim,
        dtype,
        seed=seed,
    )
    out = paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5, num_splits=1)
    check(out, reference_attention(query, k_cache, v_cache, meta, head_dim**-0.5), dtype)


@pytest.mark.parametrize(
    ("dtype", "num_splits", "query_lens"),
    [
        (torch.float32, 2, [1, 1, 1, 1]),
        (torch.float16, 3, [1, 1, 1, 1]),
        (torch.float32, 7, [1, 1, 1, 1]),  # more segments than some sequences fill: empty ones
        (torch.float16, 4, [1, 33, 1, 5]),  # the split path also handles prefill chunks
    ],
)
def test_split_kv_matches_reference(dtype, num_splits, query_lens) -> None:
    query, k_cache, v_cache, meta = make_batch(
        query_lens, [300, 0, 150, 77], 16, 8, 2, 64, dtype, seed=num_splits
    )
    out = paged_attention(query, k_cache, v_cache, meta, 0.125, num_splits=num_splits)
    check(out, reference_attention(query, k_cache, v_cache, meta, 0.125), dtype)


def test_split_heuristic() -> None:
    assert choose_num_splits(4, 8, 1, 8192, 132) == 9  # few long decodes: about two programs per SM
    assert choose_num_splits(1, 8, 1, 1024, 132) == 4  # capped by the 256-key minimum segment
    assert choose_num_splits(1, 1, 1, 100_000, 132) == 32  # capped by the maximum
    assert choose_num_splits(4, 8, 1, 512, 132) == 1  # short contexts
    assert choose_num_splits(4, 8, 2, 8192, 132) == 1  # not decode-only
    assert choose_num_splits(32, 8, 1, 8192, 132) == 1  # the plain grid already fills the GPU


def test_backend_takes_split_path_for_long_decodes() -> None:
    query, k_cache, v_cache, meta = make_batch([1, 1], [1100, 400], 32, 4, 1, 64, torch.float32, seed=5)
    backend = TritonBackend()
    assert backend.splits_for(meta, num_kv_heads=1, device=query.device) == 4
    assert TritonBackend(num_splits=1).splits_for(meta, 1, query.device) == 1
    out = backend.attend(query, k_cache, v_cache, meta, 0.125)
    check(out, reference_attention(query, k_cache, v_cache, meta, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv(dtype: torch.dtype) -> None:
    num_tokens, num_kv_heads, head_dim, block_size = 9, 2, 80, 16
    gen = torch.Generator().manual_seed(0)
    # K and V as views of a fused QKV projection output: token stride is not num_heads * head_dim.
    qkv = torch.randn((num_tokens, 4 + 2 * num_kv_heads, head_dim), generator=gen).to(dtype)
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    k_cache = torch.randn((20, block_size, num_kv_heads, head_dim), generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([5, 17, -1, 319, 0, -1, 160, 161, 42], dtype=torch.int64)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expect.view(-1, num_kv_heads, head_dim)[slot] = key[t]
            v_expect.view(-1, num_kv_heads, head_dim)[slot] = value[t]
    k_dev, v_dev = k_cache.to(TEST_DEVICE), v_cache.to(TEST_DEVICE)
    qkv_dev = qkv.to(TEST_DEVICE)
    key, value = qkv_dev[:, 4 : 4 + num_kv_heads], qkv_dev[:, 4 + num_kv_heads :]
    write_kv(key, value, k_dev, v_dev, slots.to(TEST_DEVICE))
    assert torch.equal(k_dev.cpu(), k_expect)
    assert torch.equal(v_dev.cpu(), v_expect)


def test_cache_beyond_int32_offsets() -> None:
    """Blocks past element 2^31 of a cache; torch.empty only commits the pages that get written."""
    block_size, head_dim = 16, 64
    num_blocks = 2**31 // (block_size * head_dim) + 8
    cache = torch.empty((num_blocks, block_size, 1, head_dim), dtype=torch.float16, device=TEST_DEVICE)
    high = [num_blocks - 1, num_blocks - 3, num_blocks - 6]  # every element index above 2^31
    low = [0, 1, 2]
    cache[high + low] = torch.randn((6, block_size, 1, head_dim)).half().to(TEST_DEVICE)
    table = torch.tensor([[high[0], low[0], high[1]], [low[1], high[2], low[2]]], dtype=torch.int32)
    seq_lens = [40, 35]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor([high[1] * block_size + 7, high[2] * block_size + 2], dtype=torch.int64),
        max_query_len=1,
        max_seq_len=40,
        query_lens_cpu=[1, 1],
        seq_lens_cpu=seq_lens,
    )
    meta = on_device(meta)
    new_k = torch.randn((2, 1, head_dim)).half().to(TEST_DEVICE)
    write_kv(new_k, new_k, cache, cache, meta.slot_mapping)  # K and V alias: half the memory
    assert torch.equal(cache[high[1], 7], new_k[0]) and torch.equal(cache[high[2], 2], new_k[1])
    query = torch.randn((2, 4, head_dim)).half().to(TEST_DEVICE)
    ref = reference_attention(query, cache, cache, meta, 0.125)
    for num_splits in (1, 2):
        check(paged_attention(query, cache, cache, meta, 0.125, num_splits=num_splits), ref, torch.float16)


def test_backend_plugs_into_interface() -> None:
    backend = get_backend("triton", TEST_DEVICE)
    assert isinstance(backend, TritonBackend) and backend.name == "triton"

    # One engine step: write the new tokens' K/V, then attend over cache plus new tokens.
    query_lens, context_lens, num_heads, num_kv_heads, head_dim = [1, 12, 1], [20, 5, 64], 8, 2, 64
    _, k_cache, v_cache, meta = make_batch(
        query_lens, context_lens, 16, num_heads, num_kv_heads, head_dim, torch.float32, seed=7
    )
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn((sum(query_lens), num_heads + 2 * num_kv_heads, head_dim), generator=gen).to(
        TEST_DEVICE
    )
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = backend.attend(query, k_cache, v_cache, meta, head_dim**-0.5)
    assert out.shape == query.shape

    # The reference sees the same new K/V: check it landed, then compare the attention.
    slots = meta.slot_mapping
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], key)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[slots], value)
    check(out, reference_attention(query, k_cache, v_cache, meta, head_dim**-0.5), torch.float32)


def test_empty_batch() -> None:
    _, k_cache, v_cache, meta = make_batch([1], [3], 16, 2, 1, 64, torch.float32)
    query = torch.empty((0, 2, 64), device=TEST_DEVICE)
    assert paged_attention(query, k_cache, v_cache, meta, 0.125).shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_attention_over_packed_segments(dtype) -> None:
    """A vision tower's packed attention: views into one QKV output, segments of any lengths (one
    row, odd ones, longer than a key tile), each row seeing exactly its own segment."""
    import torch.nn.functional as F

    from mm_engine.kernels.metadata import Segments
    from mm_engine.kernels.triton_varlen import varlen

    g = torch.Generator().manual_seed(5)
    heads, d = 3, 32
    segments = Segments.of([40, 1, 17, 70, 8], windows=True)
    qkv = torch.randn(sum(segments.lens), 3 * heads, d, generator=g)
    want = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(qkv[s : s + n, j * heads : (j + 1) * heads].double().transpose(0, 1) for j in range(3)),
                scale=0.25,
            ).transpose(0, 1)
            for s, n in zip(segments.starts, segments.lens, strict=True)
        ]
    ).float()
    qkv = qkv.to(TEST_DEVICE, dtype)
    out = varlen(qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :], segments, 0.25)
    torch.testing.assert_close(out.float().cpu(), want, **TOL[dtype])
