"""Paged attention in plain torch: the CPU path and the reference the Triton path must match.

It loops over the sequences of the batch, gathers each one's K/V through its block table and runs
`scaled_dot_product_attention` with a mask that lets the new tokens see the whole cached context
and each other causally. Simple, exact, and fast enough on CPU where matmuls dominate anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mm_engine.kernels.metadata import AttentionMetadata


class TorchBackend:
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_blocks, block_size, heads, dim = k_cache.shape
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(num_blocks * block_size, heads, dim).index_copy_(
            0, slot_mapping, value.to(v_cache.dtype)
        )

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        num_heads = query.shape[1]
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            q = query[start : start + q_len]  # [q_len, H, D]
            n_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[i, :n_blocks].long()
            k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            mask = None
            if q_len > 1:
                # Query j sits at position seq_len - q_len + j and may see keys up to there.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
                mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).to(k.dtype),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[start : start + q_len] = o.transpose(0, 1).to(out.dtype)
            start += q_len
        return out
