"""Paged attention in plain torch: the CPU path and the reference the Triton path must match.

Decodes (one new token each) are done together: their K/V gathered through the block tables into
one padded batch, one masked softmax over it. That keeps a step with a hundred decodes from making
thirty times a hundred small attention calls. Prompts prefilled whole in this step are grouped by
length, one causal `scaled_dot_product_attention` per group. Other prefill chunks (a later chunk
of a prompt, or one after cached blocks) loop over their sequences, gather each one's K/V and run
SDPA with a mask that lets the new tokens see the whole cached context and each other causally.

With `kernels` (the "cpu" backend: one ISA variant's C kernels, kernels/cpu_kernels.py) the C
kernels take over where they are enabled and apply: decodes through cpu_decode.c, every prefill
chunk of the step in one call to cpu_prefill.c, the K/V write through cpu_kv_write.c. Both
attention kernels read K/V in place from the pool; the prefill kernel also skips the causal
triangle SDPA computes in full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mm_engine.kernels import cpu_decode, cpu_kv_write, cpu_prefill
from mm_engine.kernels.cpu_build import takes
from mm_engine.kernels.cpu_kernels import CpuKernels
from mm_engine.kernels.cpu_layer_decode import DecodeRows
from mm_engine.kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class _Plan:
    """How one step's batch splits, worked out once and shared by every layer."""

    batched: set[int]  # sequences whose single new token goes through the batched decode
    rows: torch.Tensor | None  # their query rows; None when they are all the rows, in order
    lens: torch.Tensor  # int32 [len(batched)]: their lengths
    max_len: int
    tables: torch.Tensor  # int32 [len(batched), width]: their block tables
    others: list[int]  # the remaining sequences, in order
    others_args: tuple  # their (block tables, first rows, query lengths, lengths) for the C kernel
    # (empty without it: the torch path loops over the sequences itself)

    @classmethod
    def of(cls, meta: AttentionMetadata, c_decode: bool, c_prefill: bool) -> _Plan:
        decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        # One decode alone takes the plain path, unless the kernel is there to take it.
        if not (len(decodes) > 1 or c_decode):
            decodes = []
        everything, batched = len(decodes) == len(meta.query_lens_cpu), set(decodes)
        others = [i for i in range(meta.num_seqs) if i not in batched]
        others_args = ()
        if c_prefill and others:
            starts = meta.query_start_loc.tolist()
            others_args = (
                meta.block_tables[others],
                [starts[i] for i in others],
                [meta.query_lens_cpu[i] for i in others],
                [meta.seq_lens_cpu[i] for i in others],
            )
        return cls(
            batched=batched,
            rows=None if everything else meta.query_start_loc[:-1][decodes].long(),
            lens=meta.seq_lens[decodes].contiguous(),
            max_len=max((meta.seq_lens_cpu[i] for i in decodes), default=0),
            tables=meta.block_tables[decodes].contiguous(),
            others=others,
            others_args=others_args,
        )


class TorchBackend:
    def __init__(self, kernels: CpuKernels | None = None) -> None:
        # With `kernels`, attention goes through kernels/cpu_*.c where they are enabled and apply
        # (float32 on CPU, a head size they take); otherwise through the torch code below.
        self.kernels = kernels
        self.name = "cpu" if kernels is not None else "torch"
        self.lib = kernels.lib if kernels is not None else None
        self.c_decode, self.c_prefill, self.c_write = (
            kernels is not None and kernels.uses(k) for k in ("decode", "prefill", "kv_write")
        )
        # The step's slot mapping and what write_kv derives from it, kept for the other layers
        # (every layer of a step is handed the same tensor): (slot mapping, block size, the mask
        # of slots kept or None for all, (block, offset) of each kept slot, whether the C write may
        # take them).
        self._slots: tuple | None = None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        block_size = k_cache.shape[1]
        if self._slots is None or self._slots[0] is not slot_mapping or self._slots[1] != block_size:
            keep = slot_mapping >= 0
            kept = None if bool(keep.all()) else keep
            slots = slot_mapping if kept is None else slot_mapping[kept]
            # The C write trusts its slots: an out-of-range one goes to index_put_, which names it.
            in_range = self.c_write and (not len(slots) or int(slots.max()) < k_cache.shape[0] * block_size)
            where = (slots // block_size, slots % block_size)
            self._slots = (slot_mapping, block_size, kept, where, in_range)
        _, _, kept, where, in_range = self._slots  # where: (block, offset), for any cache strides
        if in_range and cpu_kv_write.write_kv(self.lib, key, value, k_cache, v_cache, slot_mapping):
            return
        if kept is not None:
            key, value = key[kept], value[kept]
        k_cache.index_put_(where, key.to(k_cache.dtype))
        v_cache.index_put_(where, value.to(v_cache.dtype))

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None or meta.bidirectional is not None:
            if self.c_prefill:  # every sequence, decodes too, through the C prefill kernel
                if "starts" not in meta.derived:  # once per step, not per layer
                    meta.derived["starts"] = meta.query_start_loc[:-1].tolist()
                out = cpu_prefill.paged_prefill(
                    self.lib, query, k_cache, v_cache, meta.block_tables, meta.derived["starts"],
                    meta.query_lens_cpu, meta.seq_lens_cpu, scale,
                    bidir_hi=None if meta.bidirectional is None else meta.bidirectional[1], window=window,
                )  # fmt: skip
                if out is not None:
                    return out
            return self._masked(query, k_cache, v_cache, meta, scale, window)
        num_heads = query.shape[1]
        plan = self._plan(meta)
        batched = plan.batched
        if batched and plan.rows is None:  # every row is a decode, in order: no gather, no scatter
            return self._decode(query, k_cache, v_cache, plan, scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if batched:
            out[plan.rows] = self._decode(query[plan.rows], k_cache, v_cache, plan, scale)
        if self.c_prefill and self._prefill_kernel(query, out, k_cache, v_cache, plan, scale):
            return out
        q_lens = meta.query_lens_cpu
        start = 0
        whole: dict[int, list[tuple[int, int]]] = {}  # prompt length -> [(sequence, first row)]
        for i, (q_len, seq_len) in enumerate(zip(q_lens, meta.seq_lens_cpu, strict=True)):
            if q_len == seq_len and q_len > 1:
                whole.setdefault(q_len, []).append((i, start))
            elif i not in batched:
                q = query[start : start + q_len]  # [q_len, H, D]
                out[start : start + q_len] = self._prefill(
                    q, k_cache, v_cache, meta, i, seq_len, scale, num_heads
                )
            start += q_len
        for length, seqs in whole.items():
            self._whole_prompts(query, out, k_cache, v_cache, meta, length, seqs, scale)
        return out

    def decode_rows(
        self, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> DecodeRows | None:
        """For a layer's one-call decode (models/layers/layer_decode.py): the step's rows where
        every row is one sequence's decode, in order, that this backend would write and attend with
        its C kernels (both on, every slot in the pool, float32 in the pool's own layout); else
        None, and the layer takes its modules' path. Worked out once a step."""
        # Every layer's pool has one layout: the answer is worked out once per step and layout.
        key = ("decode_rows", k_cache.dtype, k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride())
        if key not in meta.derived:
            meta.derived[key] = self._decode_rows(meta, k_cache, v_cache)
        return meta.derived[key]

    def _plan(self, meta: AttentionMetadata) -> _Plan:
        plan = meta.derived.get(self.name)
        if plan is None:
            plan = meta.derived[self.name] = _Plan.of(meta, self.c_decode, self.c_prefill)
        return plan

    def _decode_rows(self, meta: AttentionMetadata, k_cache, v_cache) -> DecodeRows | None:
        if not (self.c_decode and self.c_write) or meta.bidirectional is not None:
            return None
        if not (takes(k_cache, v_cache) and k_cache.transpose(1, 2).is_contiguous()):
            return None
        if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
            return None
        plan, slots = self._plan(meta), meta.slot_mapping
        if plan.others or plan.rows is not None or not plan.batched:
            return None
        if slots.dtype != torch.int64 or slots.device.type != "cpu" or not slots.is_contiguous():
            return None
        if int(slots.min()) < 0 or int(slots.max()) >= k_cache.shape[0] * k_cache.shape[1]:
            return None
        tables = plan.tables.to(torch.int32).contiguous()
        return DecodeRows(slots, tables, plan.lens.to(torch.int32).contiguous(), plan.max_len)

    def _prefill_kernel(self, query, out, k_cache, v_cache, plan: _Plan, scale: float) -> bool:
        """Every sequence not batched as a decode through the C prefill kernel in one call, written
        into `out`; False (nothing written) where the kernel does not apply."""
        if not plan.others:
            return True
        return (
            cpu_prefill.paged_prefill(self.lib, query, k_cache, v_cache, *plan.others_args, scale, out=out)
            is not None
        )

    def _whole_prompts(self, query, out, k_cache, v_cache, meta, length: int, seqs, scale: float) -> None:
        """Prompts of one length prefilled whole in this step (no cached context), in one causal
        SDPA call: a captioning batch is many prompts of exactly one length, and one call over
        them beats one call each."""
        block_size, num_kv_heads = k_cache.shape[1:3]
        tables = meta.block_tables[[i for i, _ in seqs]]
        k = self._gather(k_cache, tables, -(-length // block_size))[:, :, :length]  # [B, KVH, L, D]
        v = self._gather(v_cache, tables, -(-length // block_size))[:, :, :length]
        q = torch.stack([query[row : row + length] for _, row in seqs]).transpose(1, 2)  # [B, H, L, D]
        o = F.scaled_dot_product_attention(
            q.to(k.dtype), k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != num_kv_heads
        )
        o = o.transpose(1, 2).to(query.dtype)  # [B, L, H, D]
        for j, (_, row) in enumerate(seqs):
            out[row : row + length] = o[j]

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """`[seqs, kv_heads, n_blocks * block_size, head_dim]`, contiguous: the first blocks of each
        table."""
        num_blocks, block_size, kv_heads, head_dim = cache.shape
        blocks = tables[:, :n_blocks].long()
        by_head = cache.transpose(1, 2)  # [blocks, kv_heads, slots, dim]
        if by_head.is_contiguous():
            # The pool's own layout (pools.kv_cache): one contiguous run per (block, head), so
            # the gather is whole-run copies and needs no transpose afterwards.
            rows = blocks[:, None, :] * kv_heads + torch.arange(kv_heads, device=cache.device)[:, None]
            runs = by_head.view(num_blocks * kv_heads, block_size * head_dim).index_select(0, rows.flatten())
            return runs.view(len(blocks), kv_heads, n_blocks * block_size, head_dim)
        g = by_head[blocks]  # any other layout: [seqs, n_blocks, kv_heads, slots, dim]
        g = g.transpose(1, 2).reshape(len(blocks), kv_heads, n_blocks * block_size, head_dim)
        return g.contiguous()

    def _prefill(self, q, k_cache, v_cache, meta, i: int, seq_len: int, scale: float, num_heads: int):
        q_len, (block_size, num_kv_heads, _) = q.shape[0], k_cache.shape[1:]
        n_blocks = -(-seq_len // block_size)
        k = self._gather(k_cache, meta.block_tables[i : i + 1], n_blocks)[0, :, :seq_len]
        v = self._gather(v_cache, meta.block_tables[i : i + 1], n_blocks)[0, :, :seq_len]
        # Whole prompts went to `_whole_prompts`; here q_len < seq_len, or a lone one-token prompt.
        mask = None
        if q_len < seq_len:
            # Query j sits at position seq_len - q_len + j and may see keys up to there.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(k.dtype),
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return o.transpose(0, 1).to(q.dtype)

    def _masked(self, query, k_cache, v_cache, meta, scale: float, window: int | None) -> torch.Tensor:
        """Every sequence with its own explicit mask: causal, plus each token's bidirectional range,
        within the sliding window (the reference; the cpu backend's C prefill kernel takes both)."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        block_size, num_kv_heads = k_cache.shape[1:3]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            n_blocks = -(-seq_len // block_size)
            k = self._gather(k_cache, meta.block_tables[i : i + 1], n_blocks)[0, :, :seq_len]
            v = self._gather(v_cache, meta.block_tables[i : i + 1], n_blocks)[0, :, :seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if meta.bidirectional is not None:
                lo, hi = (t[start : start + q_len, None] for t in meta.bidirectional)
                mask |= (k_pos >= lo) & (k_pos < hi)
            if window is not None:
                mask &= k_pos > q_pos - window
            q = query[start : start + q_len].transpose(0, 1).to(k.dtype)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != num_kv_heads
            )
            out[start : start + q_len] = o.transpose(0, 1).to(query.dtype)
            start += q_len
        return out

    def _decode(self, q, k_cache, v_cache, plan: _Plan, scale: float) -> torch.Tensor:
        """One query token per sequence: q `[n, H, D]` -> `[n, H, D]`."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        lens, max_len, tables = plan.lens, plan.max_len, plan.tables
        n_blocks = -(-max_len // block_size)
        if self.c_decode:
            out = cpu_decode.paged_decode(self.lib, q, k_cache, v_cache, tables, lens, max_len, scale)
            if out is not None:
                return out
        k = self._gather(k_cache, tables, n_blocks)  # [n, KVH, T, D]
        v = self._gather(v_cache, tables, n_blocks)
        n, num_heads = q.shape[:2]
        group, t = num_heads // num_kv_heads, k.shape[2]
        # Query heads h*group .. (h+1)*group - 1 share KV head h: one batch entry per (sequence,
        # KV head), its group of queries against that head's keys.
        qg = q.to(k.dtype).reshape(n * num_kv_heads, group, head_dim)
        scores = torch.bmm(qg, k.view(n * num_kv_heads, t, head_dim).transpose(1, 2))
        pad = torch.arange(t, device=q.device)[None, :] >= lens[:, None].to(q.device)  # [n, T]
        # Slots past a sequence's end hold stale (on CPU: uninitialized) values, and a zero weight
        # times NaN is NaN: zero them in the gathered V (only those slots are written). In K they
        # only reach scores, which the mask overwrites.
        v.transpose(1, 2)[pad.nonzero(as_tuple=True)] = 0.0
        scores = scores.view(n, num_kv_heads, group, t).mul_(scale)
        probs = scores.masked_fill_(pad[:, None, None, :], float("-inf")).softmax(dim=-1)
        out = torch.bmm(probs.view(n * num_kv_heads, group, t), v.view(n * num_kv_heads, t, head_dim))
        return out.view(n, num_heads, head_dim).to(q.dtype)
