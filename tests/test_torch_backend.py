"""The CPU attention backend's batched decode: equal to plain attention over each sequence's own
keys, whatever the unused cache slots hold (on CPU the KV pool is uninitialized memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mm_engine.kernels.metadata import AttentionMetadata
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
    keys, values = [], []
    for n, table in zip(lens, tables, strict=True):
        k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
        for pos in range(n):
            k_cache[table[pos // bs], pos % bs], v_cache[table[pos // bs], pos % bs] = k[pos], v[pos]
        keys.append(k)
        values.append(v)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        max_query_len=1,
        max_seq_len=max(lens),
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )
    q = torch.randn(len(lens), heads, d, generator=g)
    out = TorchBackend().attend(q, k_cache, v_cache, meta, scale=d**-0.5)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        ref = F.scaled_dot_product_attention(
            q[i : i + 1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=d**-0.5, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[i : i + 1], ref)


def test_write_kv_fills_the_slots_of_the_pool_layout_and_skips_negative_ones():
    g = torch.Generator().manual_seed(1)
    blocks, bs, kvh, d = 6, 4, 3, 8
    k_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").zero_()
    v_cache = paged_kv_tensor(blocks, bs, kvh, d, torch.float32, "cpu").zero_()
    key, value = torch.randn(4, kvh, d, generator=g), torch.randn(4, kvh, d, generator=g)
    slots = torch.tensor([5, -1, 23, 0])
    TorchBackend().write_kv(key, value, k_cache, v_cache, slots)
    for tok, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // bs, slot % bs], key[tok])
            assert torch.equal(v_cache[slot // bs, slot % bs], value[tok])
    assert int((k_cache != 0).any(-1).sum()) == 3 * kvh  # nothing else written
