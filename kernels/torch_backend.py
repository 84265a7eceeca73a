"""Paged attention in plain torch: the CPU path and the reference the Triton path must match.

Decodes (one new token each) are done together: their K/V gathered through the block tables into
one padded batch, one masked softmax over it. That keeps a step with a hundred decodes from making
thirty times a hundred small attention calls. Prefill chunks loop over their sequences, gather
each one's K/V and run `scaled_dot_product_attention` with a mask that lets the new tokens see the
whole cached context and each other causally (plain causal when there is no cached context).
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
        num_heads = query.shape[1]
        out = torch.empty_like(query)
        q_lens = meta.query_lens_cpu
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        batched = set(decodes) if len(decodes) > 1 else set()  # one decode alone: the plain path
        if batched:
            rows = meta.query_start_loc[:-1][decodes].long()
            out[rows] = self._decode(query[rows], k_cache, v_cache, meta, decodes, scale)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(q_lens, meta.seq_lens_cpu, strict=True)):
            if i not in batched:
                q = query[start : start + q_len]  # [q_len, H, D]
                out[start : start + q_len] = self._prefill(
                    q, k_cache, v_cache, meta, i, seq_len, scale, num_heads
                )
            start += q_len
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """[seqs, n_blocks * block_size, kv_heads, head_dim]: the first blocks of each table."""
        g = cache[tables[:, :n_blocks].long()]
        return g.reshape(g.shape[0], -1, *cache.shape[2:])

    def _prefill(self, q, k_cache, v_cache, meta, i: int, seq_len: int, scale: float, num_heads: int):
        q_len, (block_size, num_kv_heads, _) = q.shape[0], k_cache.shape[1:]
        n_blocks = -(-seq_len // block_size)
        k = self._gather(k_cache, meta.block_tables[i : i + 1], n_blocks)[0, :seq_len]
        v = self._gather(v_cache, meta.block_tables[i : i + 1], n_blocks)[0, :seq_len]
        mask, causal = None, False
        if q_len == seq_len:
            causal = q_len > 1
        else:
            # Query j sits at position seq_len - q_len + j and may see keys up to there.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(k.dtype),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return o.transpose(0, 1).to(q.dtype)

    def _decode(self, q, k_cache, v_cache, meta, seqs: list[int], scale: float) -> torch.Tensor:
        """One query token per sequence: q `[n, H, D]` -> `[n, H, D]`."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        lens = meta.seq_lens[seqs]
        n_blocks = -(-max(meta.seq_lens_cpu[i] for i in seqs) // block_size)
        tables = meta.block_tables[seqs]
        k = self._gather(k_cache, tables, n_blocks)  # [n, T, KVH, D]
        v = self._gather(v_cache, tables, n_blocks)
        n, num_heads = q.shape[:2]
        group, t = num_heads // num_kv_heads, k.shape[1]
        # The gathered K/V are [n, T, KVH, D]; viewed as [n, T*KVH, D] they feed bmm without a
        # copy into a head-major layout (which cost more than the attention itself). Each query
        # head is scored against every KV head and only its own group's scores are kept: KVH
        # times the (small) attention FLOPs, no layout copy.
        scores = torch.bmm(q.to(k.dtype), k.view(n, t * num_kv_heads, head_dim).transpose(1, 2))
        scores = scores.view(n, num_kv_heads, group, t, num_kv_heads).diagonal(dim1=1, dim2=4)  # [n,G,T,KVH]
        pad = torch.arange(t, device=q.device)[None, :] >= lens[:, None].to(q.device)
        # Slots past a sequence's end hold stale (on CPU: uninitialized) values, and a zero weight
        # times NaN is NaN: zero them in the gathered copy (only those slots are written).
        v[pad.nonzero(as_tuple=True)] = 0.0
        probs = (scores * scale).masked_fill(pad[:, None, :, None], float("-inf")).softmax(dim=2)
        spread = probs.new_zeros(n, num_kv_heads, group, t, num_kv_heads)
        spread.diagonal(dim1=1, dim2=4).copy_(probs)
        out = torch.bmm(spread.view(n, num_heads, t * num_kv_heads), v.view(n, t * num_kv_heads, head_dim))
        return out.to(q.dtype)
