"""Building paged-attention inputs by hand: a KV pool filled through block tables, and the
metadata of one varlen batch."""

from __future__ import annotations

import torch

from mm_engine.kernels.metadata import AttentionMetadata


def fill_pool(k_cache, v_cache, lens: list[int], tables: list[list[int]], g) -> tuple[list, list]:
    """Random K/V for each sequence's first `len` slots through its table; returns them per sequence."""
    bs, kvh, d = k_cache.shape[1:]
    keys, values = [], []
    for n, table in zip(lens, tables, strict=True):
        k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
        for pos in range(n):
            k_cache[table[pos // bs], pos % bs], v_cache[table[pos // bs], pos % bs] = k[pos], v[pos]
        keys.append(k)
        values.append(v)
    return keys, values


def make_meta(seq_lens: list[int], q_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(map(len, tables))
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
