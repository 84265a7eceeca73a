"""The Triton attention backend: the KV-write and paged-attention kernels behind the backend interface.

On CUDA this is the fast path. On CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1),
which is how the tests check it. The backend also owns the split-KV (flash-decoding) policy.
"""

from __future__ import annotations

import torch
import triton

from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.kernels.triton_attention import paged_attention
from mm_engine.kernels.triton_kv_write import write_kv

# Split-KV only for decode-only batches whose longest sequence has at least this many tokens...
SPLIT_MIN_SEQ_LEN = 1024
# ...into segments of at least this many keys (so the merge stays cheap), and at most this many.
SPLIT_MIN_SEGMENT = 256
SPLIT_MAX = 32
# Without a CUDA device (the interpreter) assume an H100-class SM count, so the policy is testable.
DEFAULT_NUM_SMS = 132


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, sms: int
) -> int:
    """KV segments per sequence: 1 (no split) unless the plain grid would leave SMs idle.

    A decode program (one sequence, one KV head, all its query heads) streams the whole context. With
    fewer such programs than SMs, most of the GPU waits on a few long sequences; splitting the context
    aims at about two programs per SM instead.
    """
    if max_query_len != 1 or max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    splits = min(triton.cdiv(2 * sms, programs), max_seq_len // SPLIT_MIN_SEGMENT, SPLIT_MAX)
    return max(splits, 1)


class TritonBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # None: split-KV decided per batch by `choose_num_splits`; 1: never split; > 1: always split
        # into that many segments, any batch (tests and benchmarks force the path this way).
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be None or >= 1, got {num_splits}")
        self.num_splits = num_splits

    def splits_for(self, meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return choose_num_splits(
            meta.num_seqs, num_kv_heads, meta.max_query_len, meta.max_seq_len, num_sms(device)
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        num_splits = self.splits_for(meta, k_cache.shape[2], query.device)
        return paged_attention(query, k_cache, v_cache, meta, scale, num_splits=num_splits, window=window)
