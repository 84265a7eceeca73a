"""The CPU attention backend's batched decode: equal to plain attention over each sequence's own
keys, whatever the unused cache slots hold (on CPU the KV pool is uninitialized memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.torch_backend import TorchBackend


def test_batched_decode_matches_per_sequence_attention_with_garbage_in_unused_slots():
    g = torch.Generator().manual_seed(0)
    blocks, bs, kvh, heads, d = 12, 4, 2, 6, 8
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
