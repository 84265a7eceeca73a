"""A vision tower's packed attention in Triton, on the paged kernel (kernels/triton_attention.py):
each segment (an image, a frame or a window) is a sequence whose every row sees the whole segment,
its K/V read in place from the projection output as one block that starts at the segment's first
row (blocks one row apart, as long as the longest segment)."""

from __future__ import annotations

import torch

from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.triton_attention import paged_attention


def varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments, scale: float):
    """Full attention within each segment of packed rows (`kernels.metadata.Segments`), `[tokens,
    heads, dim]` each (views into one QKV output are fine) -> `[tokens, heads, dim]`. Blocks one
    row apart and as long as the longest segment: block `starts[i]` is segment i's rows."""
    tokens, heads, dim = key.shape
    if key.stride() != value.stride() or key.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    row, head, _ = key.stride()
    longest = max(segments.lens)
    k = key.as_strided((1, longest, heads, dim), (row, row, head, 1))
    v = value.as_strided((1, longest, heads, dim), (row, row, head, 1))
    device = query.device
    lens = torch.tensor(segments.lens, dtype=torch.int32)
    per_row = torch.repeat_interleave(lens.long(), lens)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([*segments.starts, tokens], dtype=torch.int32, device=device),
        seq_lens=lens.to(device),
        block_tables=torch.tensor(segments.starts, dtype=torch.int32, device=device)[:, None],
        slot_mapping=torch.zeros(tokens, dtype=torch.long, device=device),  # nothing is written
        max_query_len=longest,
        max_seq_len=longest,
        query_lens_cpu=list(segments.lens),
        seq_lens_cpu=list(segments.lens),
        bidirectional=(torch.zeros(tokens, dtype=torch.long, device=device), per_row.to(device)),
    )
    return paged_attention(query, k, v, meta, scale)
