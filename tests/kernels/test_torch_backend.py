"""The CPU attention backend's batched decode: equal to plain attention over each sequence's own
keys, whatever the unused cache slots hold (on CPU the KV pool is uninitialized memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.attention import fill_pool, make_meta
from mm_engine.kernels import cpu_decode, cpu_kv_write
from mm_engine.kernels.torch_backend import TorchBackend
from mm_engine.pools.kv_cache import paged_kv_tensor


@pytest.mark.parametrize("layout", ["pool", "token-major"])
def test_batched_decode_matches_per_sequence_attention_with_garbage_in_unused_slots(layout):
    """Both the pool's head-major storage and a plain contiguous cache (the gather's fallback)."""
    g = torch.Generator().manual_seed(0)
    blocks, bs, kvh, heads, d = 12, 4, 2, 6, 8
    if layout == "pool":
        k_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
        v_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").fill_(float("inf"))
    else:
        k_cache = torch.full((blocks, bs, kvh, d), float("nan"))
        v_cache = torch.full((blocks, bs, kvh, d), float("inf"))
    lens = [5, 11, 1]
    tables = [[3, 7], [0, 9, 4], [11]]
    keys, values = fill_pool(k_cache, v_cache, lens, tables, g)
    meta = make_meta(lens, [1] * len(lens), tables)
    q = torch.randn(len(lens), heads, d, generator=g)
    out = TorchBackend().attend(q, k_cache, v_cache, meta, scale=d**-0.5)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        ref = F.scaled_dot_product_attention(
            q[i : i + 1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=d**-0.5, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[i : i + 1], ref)


@pytest.mark.parametrize("c_kernels", [False, True])
@pytest.mark.parametrize("tokens", [4, 300])  # 300: the C copy's threaded path
def test_write_kv_fills_the_slots_of_the_pool_layout_and_skips_negative_ones(c_kernels, tokens, cpu_kernels):
    """Key and value are strided views into one fused projection output, as the model hands them."""
    g = torch.Generator().manual_seed(1)
    blocks, bs, kvh, d = 100, 4, 3, 8
    k_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").zero_()
    v_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").zero_()
    fused = torch.randn(tokens, 5 * kvh * d, generator=g)
    key = fused[:, 2 * kvh * d : 3 * kvh * d].view(tokens, kvh, d)
    value = fused[:, 4 * kvh * d :].reshape(tokens, kvh, d)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    slots[1] = -1
    TorchBackend(cpu_kernels if c_kernels else None).write_kv(key, value, k_cache, v_cache, slots)
    for tok, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // bs, slot % bs], key[tok])
            assert torch.equal(v_cache[slot // bs, slot % bs], value[tok])
    assert int((k_cache != 0).any(-1).sum()) == (tokens - 1) * kvh  # nothing else written
    assert int((v_cache != 0).any(-1).sum()) == (tokens - 1) * kvh
    if c_kernels:  # and the C copy took these views itself, rather than leaving them to torch
        k_again, v_again = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        assert cpu_kv_write.write_kv(cpu_kernels.lib, key, value, k_again, v_again, slots)
        assert torch.equal(k_again, k_cache) and torch.equal(v_again, v_cache)


def test_write_kv_out_of_the_pool_is_an_index_error_on_the_c_path_too(cpu_kernels):
    k_cache = paged_kv_tensor(2, 4, 1, 8, torch.float32, "cpu").zero_()
    v_cache = paged_kv_tensor(2, 4, 1, 8, torch.float32, "cpu").zero_()
    key = torch.randn(2, 1, 8)
    with pytest.raises(IndexError):
        TorchBackend(cpu_kernels).write_kv(key, key, k_cache, v_cache, torch.tensor([3, 8]))


@pytest.mark.parametrize(
    ("heads", "kvh", "d"),
    [(6, 2, 8), (9, 3, 64), (4, 4, 16), (16, 1, 32), (8, 2, 80), (12, 2, 96), (4, 1, 128), (2, 1, 256)],
)
def test_c_decode_kernel_matches_the_torch_path(heads, kvh, d, cpu_kernels):
    """The "cpu" backend's C kernel against the plain torch path, over NaN-filled unused slots,
    lengths that end mid-block, one lone decode, query/KV-head groupings from MHA to MQA, and the
    head sizes of real checkpoints (64, 80, 96, 128, 256)."""
    g = torch.Generator().manual_seed(2)
    blocks, bs = 40, 4
    k_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
    v_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
    lens, tables = [5, 13, 1, 8], [[3, 7], [0, 9, 4, 20], [11], [30, 31]]
    fill_pool(k_cache, v_cache, lens, tables, g)
    q = torch.randn(len(lens), heads, d, generator=g)
    for picked in ([0, 1, 2, 3], [1]):
        meta = make_meta([lens[i] for i in picked], [1] * len(picked), [tables[i] for i in picked])
        want = TorchBackend().attend(q[picked], k_cache, v_cache, meta, scale=d**-0.5)
        got = TorchBackend(cpu_kernels).attend(q[picked], k_cache, v_cache, meta, scale=d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_loading_the_c_kernel_leaves_the_process_floating_point_state_alone(cpu_lib):
    """Linked with -ffast-math, a library can switch on flush-to-zero for the whole process."""
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert torch.tensor([1e-40]).mul(1.0).item() > 0.0  # a float32 subnormal


def test_c_decode_kernel_declines_what_it_cannot_take(cpu_kernels):
    """Not float32, or not the pool's layout: None, and the backend falls back to torch."""
    lib = cpu_kernels.lib
    cache = paged_kv_tensor(4, 4, 2, 8, torch.float32, "cpu").zero_()
    meta = make_meta([3, 2], [1, 1], [[0], [1]])
    q = torch.randn(2, 2, 8)
    assert (
        cpu_decode.paged_decode(lib, q.double(), cache, cache, meta.block_tables, meta.seq_lens, 3, 1.0)
        is None
    )
    plain = torch.zeros(4, 4, 2, 8)  # token-major, contiguous
    assert cpu_decode.paged_decode(lib, q, plain, plain, meta.block_tables, meta.seq_lens, 3, 1.0) is None
    out = TorchBackend(cpu_kernels).attend(q, plain, plain, meta, scale=1.0)
    assert torch.equal(out, torch.zeros_like(q))


def test_whole_prompts_of_one_length_share_a_call_and_match_per_sequence_attention(cpu_kernels):
    """Two prompts of length 6 (one SDPA call), one of length 3, one later chunk after cached
    context, and a decode, in one step: each equals causal attention over its own keys."""
    g = torch.Generator().manual_seed(3)
    blocks, bs, kvh, heads, d = 20, 4, 2, 4, 8
    k_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
    v_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").fill_(float("nan"))
    seq_lens, q_lens = [6, 3, 6, 7, 5], [6, 3, 6, 2, 1]
    tables = [[0, 1], [2, 9], [3, 4], [5, 6], [7, 8]]  # block 9: padding, never read
    keys, values = fill_pool(k_cache, v_cache, seq_lens, tables, g)
    meta = make_meta(seq_lens, q_lens, tables)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    for backend in (TorchBackend(), TorchBackend(cpu_kernels)):
        out = backend.attend(q, k_cache, v_cache, meta, scale=d**-0.5)
        start = 0
        for k, v, n, m in zip(keys, values, seq_lens, q_lens, strict=True):
            mask = torch.ones(n, n, dtype=torch.bool).tril()[n - m :]  # the last m queries
            ref = F.scaled_dot_product_attention(
                q[start : start + m].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=d**-0.5,
                enable_gqa=True,
            ).transpose(0, 1)
            torch.testing.assert_close(out[start : start + m], ref)
            start += m
