"""Turns one scheduled batch into tensors and runs one forward over it.

The batch is flat (varlen): the new tokens of every scheduled request one after the other, prefill
chunks and decodes together. Images whose tokens fall in this step's chunks are encoded first, in
one call (of any sizes: the family's `encode` packs them), and their features replace the
embeddings of the run positions that carry them; DeepStack features ride along to the first
layers. Logits are computed only for the requests whose chunk reaches their last token, i.e. the
ones that sample this step.

With overlapped scheduling a decode's input may be a token that the previous step sampled and that
is still on the device (`PLACEHOLDER` in the request's ids): `prepare` notes where it goes, and
`forward` copies it from the previous step's sampled tokens, in launch order, before embedding.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from mm_engine.core.image_features import ImageFeatures
from mm_engine.core.step_inputs import StepInputs, StepRows
from mm_engine.kernels.backend import AttentionBackend
from mm_engine.kernels.host_copy import to_device
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.models.interface import MultimodalModel
from mm_engine.parallel.ranks import torch_threads
from mm_engine.pools.kv_cache import KVCache
from mm_engine.pools.state_pool import StatePool
from mm_engine.request import ImageSpan, Request
from mm_engine.sched.scheduler import ScheduledBatch
from mm_engine.vision.encoder_cache import EncoderCache

PLACEHOLDER = -1  # a sampled token not read back to the host yet (overlapped scheduling)


class Peers(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them (parallel/executor.py)."""

    turn: AbstractContextManager  # held while a forward's messages and collectives go out

    def send(self, inputs: StepInputs, prev_tokens: torch.Tensor | None) -> None: ...

    def broken(self, exc: BaseException) -> Exception: ...


class ModelRunner:
    def __init__(
        self,
        model: MultimodalModel,
        kv: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        encoder_cache: EncoderCache,
        *,
        peers: Peers | None = None,
        encoder: Callable[[list[ImageSpan]], list[torch.Tensor]] | None = None,
        threads: int | None = None,
        states: StatePool | None = None,
    ) -> None:
        """`peers`: under tensor parallelism (rank 0), what hands each forward's inputs to the
        workers first. `encoder`: what encodes a step's images (default the model's own; under TP
        with mm_encoder_tp_mode "data", every rank a share). `threads`: torch threads of this
        runner's work (tensor-parallel ranks on a CPU share its cores); None: the caller's.
        `states`: a hybrid model's recurrent-state pool, whose tensors its linear layers update."""
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.block_size = kv.spec.block_size
        self.peers = peers
        self.encoder = encoder or model.encode
        # The features of images, as the scheduler's batches say (encoded, held, passed, released).
        self.features = ImageFeatures(self.encoder, encoder_cache, model.tower_depth)
        self.threads = threads
        self.states = states

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int], list]:
        """Returns logits `[len(sampling) + prompt rows, vocab]`, the indices into `batch.items`
        that sample (the first rows of the logits), and the prompt-logprob rows after them."""
        inputs = self.prepare(batch)
        logits, sampling = self.forward(inputs)
        return logits, sampling, inputs.prompt_rows

    def prepare(self, batch: ScheduledBatch, pending: dict[str, int] | None = None) -> StepInputs:
        """Everything a forward needs, as tensors on the device: the host's share of a step
        (the batch's new images are encoded here too, or taken from the encoder cache).
        `pending`: request id -> index among the previous step's samples, for the requests whose
        last token is still a `PLACEHOLDER`. The batch's KV block copies run before anything else."""
        with torch_threads(self.threads):
            return self._prepare(batch, pending)

    @torch.inference_mode()
    def _prepare(self, batch: ScheduledBatch, pending: dict[str, int] | None) -> StepInputs:
        items, copies = batch.items, batch.copies
        self.features.advance_slices(batch.encode_slices)
        self.features.take_new(batch.new_images)
        rows = StepRows()
        for k, (req, n) in enumerate(items):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            row0 = len(rows.ids)
            self._add_tokens(rows, req, start, end, pending)
            if start < req.num_prompt_tokens:  # a prompt chunk: its images and prompt logprobs
                self._add_prompt_rows(rows, k, req, start, end, row0)
            if end == req.num_tokens:
                rows.sample_rows.append(len(rows.ids) - 1)
                rows.sampling.append(k)
        inputs = self._tensors(rows, items, copies, batch)
        self.features.drop_passed(batch.passed_images)  # what this step needs is in `inputs` now
        return inputs

    def _add_tokens(
        self, rows: StepRows, req: Request, start: int, end: int, pending: dict[str, int] | None
    ) -> None:
        """A request's new tokens: ids, KV slots, positions, and where a placeholder's token comes
        from. A decode (one token) takes the short path: it is most rows of most steps."""
        bs, table = self.block_size, req.block_table
        if end - start == 1:
            rows.ids.append(req.token_ids[start])
            rows.slots.append(table[start // bs] * bs + start % bs)
        else:
            rows.ids.extend(req.token_ids[start:end])
            rows.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if rows.ids[-1] == PLACEHOLDER:  # only ever a request's last token
            rows.prev_rows.append(len(rows.ids) - 1)
            rows.prev_src.append(pending[req.request_id])
        if self.model.uses_mrope:
            rows.mrope_positions.append(self._positions(req, start, end))
        elif end - start == 1:
            rows.positions.append(start)
        else:
            rows.positions.extend(range(start, end))

    def _add_prompt_rows(self, rows: StepRows, k: int, req: Request, start: int, end: int, row0: int) -> None:
        """A prompt chunk's extra rows: the prompt logprobs it asks for, and the rows its images'
        features replace (with the runs that attend both ways, for families that ask)."""
        if req.params.prompt_logprobs is not None and req.first_token_time is None:
            lo, hi = max(start, len(req.prompt_logprobs)), min(end, req.num_prompt_tokens - 1)
            if lo < hi:  # position p's logits predict prompt token p + 1
                rows.extra_rows.extend(range(row0 + lo - start, row0 + hi - start))
                rows.prompt_rows.append((k, lo, hi - lo))
        for j, span in enumerate(req.images):
            a, b = max(start, span.offset), min(end, span.offset + span.length)
            if a >= b:
                continue
            embed, first = _embed_rows(span, a - span.offset, b - span.offset)
            rows.embed_rows.append(embed + (row0 + span.offset - start))
            rows.embed_feats.append(self.features.get(req.request_id, j)[first : first + embed.numel()])
            if self.model.bidirectional_images:
                for lo, hi in span.embed_runs():  # one per image (Gemma 3: and per crop)
                    inside = (embed >= lo - span.offset) & (embed < hi - span.offset)
                    if bool(inside.any()):
                        rows.bidirectional.append((rows.embed_rows[-1][inside], lo, hi))

    def _tensors(
        self, rows: StepRows, items: list[tuple[Request, int]], copies: list[tuple[int, int]],
        batch: ScheduledBatch,
    ) -> StepInputs:  # fmt: skip
        """The host's rows as the forward's tensors on the device (copies that do not wait)."""
        dev = self.device
        meta = self._metadata(items, rows.slots, batch.state_snapshots)
        if rows.bidirectional:
            meta.bidirectional = self._ranges(len(rows.ids), rows.bidirectional)
        ids = to_device(rows.ids, torch.long, dev)
        embed_rows = embed_feats = None
        if rows.embed_rows:
            embed_rows = to_device(torch.cat(rows.embed_rows), None, dev)
            embed_feats = torch.cat(rows.embed_feats)
            # Image-token ids may lie outside the vocabulary; their embeddings are replaced anyway.
            # (Only prompt positions: a generated image-token id is embedded like any other token.)
            ids[embed_rows] = 0
        if self.model.uses_mrope:
            positions = to_device(torch.cat(rows.mrope_positions, dim=-1), None, dev)
        else:
            positions = to_device(rows.positions, torch.long, dev)
        from_prev = None
        if rows.prev_rows:
            from_prev = (
                to_device(rows.prev_rows, torch.long, dev),
                to_device(rows.prev_src, torch.long, dev),
            )
        wanted = rows.sample_rows + rows.extra_rows
        block_copies, state_copies = self._pairs(copies), self._pairs(batch.state_copies)
        return StepInputs(
            ids, positions, meta, embed_rows, embed_feats, rows.sample_rows, rows.sampling, from_prev,
            rows.extra_rows, rows.prompt_rows, to_device(wanted, torch.long, dev) if wanted else None,
            block_copies, state_copies,
        )  # fmt: skip

    def forward(
        self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """One forward over prepared inputs: logits of the rows that sample, and which items.
        `prev_tokens`: the previous step's sampled tokens, where `inputs.from_prev` takes some."""
        with torch_threads(self.threads):
            if self.peers is None:
                return self._forward(inputs, prev_tokens)
            with self.peers.turn:  # in the forward's own order (the CUDA stream, the launcher thread)
                self.peers.send(inputs, prev_tokens if inputs.from_prev is not None else None)
                try:
                    return self._forward(inputs, prev_tokens)
                except Exception as exc:  # the workers are inside this forward's collectives
                    raise self.peers.broken(exc) from exc

    @torch.inference_mode()
    def _forward(self, inputs: StepInputs, prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        if inputs.block_copies is not None:  # before this step writes any KV
            self.kv.copy_blocks(*inputs.block_copies)
        if inputs.state_copies is not None:  # snapshots into the slots of requests that reuse a prefix
            self.states.copy_rows(*inputs.state_copies)
        lm = self.model.language_model
        ids = inputs.ids
        if inputs.from_prev is not None:
            if prev_tokens is None:
                raise ValueError("these inputs take the previous step's tokens; pass prev_tokens")
            rows, src = inputs.from_prev
            # (A NO_TOKEN row's request ends when its token is read; its stale row here needs an id.)
            ids = ids.index_put((rows,), prev_tokens[src].clamp_min(0))
        embeds = lm.embed_tokens(ids)
        deepstack = None
        if inputs.embed_rows is not None:
            embeds[inputs.embed_rows] = inputs.embed_feats[:, 0].to(embeds.dtype)
            if inputs.embed_feats.shape[1] > 1:
                deepstack = (inputs.embed_rows, inputs.embed_feats[:, 1:])
        extra = {} if self.states is None else {"states": self.states}
        if getattr(lm, "reads_token_ids", False):  # per-layer embeddings (Gemma 4) look tokens up
            extra.update(token_ids=ids, image_rows=inputs.embed_rows)
        hidden = lm(
            embeds, inputs.positions, self.kv.k, self.kv.v, inputs.meta, self.backend, deepstack, **extra
        )
        if inputs.logit_rows is None:
            return hidden.new_empty((0, 0)), inputs.sampling
        logits = lm.logits(hidden.index_select(0, inputs.logit_rows))
        return logits, inputs.sampling

    def _pairs(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sources, destinations) of copies on the device; None for none."""
        if not pairs:
            return None
        src, dst = zip(*pairs, strict=True)
        return to_device(list(src), torch.long, self.device), to_device(list(dst), torch.long, self.device)

    def _ranges(
        self, n: int, pieces: list[tuple[torch.Tensor, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per flat row, the positions `[lo, hi)` it sees in both directions: its image's
        embedding positions for an image's embedding rows, none for every other row."""
        lo, hi = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        for rows, a, b in pieces:
            lo[rows], hi[rows] = a, b
        return to_device(lo, None, self.device), to_device(hi, None, self.device)

    def _positions(self, req: Request, start: int, end: int) -> torch.Tensor:
        """Rotary positions of tokens `[start, end)`: `[n]`, or `[3, n]` for an M-RoPE model, whose
        prompt positions were computed when the request was added; later tokens (decode, or the
        output recomputed after preemption) continue at `i + delta` on every axis."""
        if not self.model.uses_mrope:
            return torch.arange(start, end)
        stored = req.mrope_positions
        cut = start if stored is None else min(end, max(start, stored.shape[1]))
        tail = torch.arange(cut, end) + req.mrope_delta
        if stored is None or cut == start:
            return tail.expand(3, -1)
        return torch.cat([stored[:, start:cut], tail.expand(3, -1)], dim=1)

    def _metadata(
        self, items: list[tuple[Request, int]], slots: list[int], snapshots: dict[str, list[tuple[int, int]]]
    ) -> AttentionMetadata:
        q_lens = [n for _, n in items]
        seq_lens = [req.num_computed_tokens + n for req, n in items]
        width = max(len(req.block_table) for req, _ in items)
        tables = [req.block_table + [0] * (width - len(req.block_table)) for req, _ in items]
        dev = self.device
        return AttentionMetadata(
            query_start_loc=to_device([0, *itertools.accumulate(q_lens)], torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            block_tables=to_device(tables, torch.int32, dev),
            slot_mapping=to_device(slots, torch.long, dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            state_slots_cpu=[req.state_slot for req, _ in items] if self.states is not None else None,
            state_snapshots_cpu=[snapshots.get(req.request_id, []) for req, _ in items]
            if snapshots
            else None,
        )

    @torch.inference_mode()
    def encode_only(self, batch: ScheduledBatch) -> list:
        """A step with image shares to run and no tokens to compute (every request it serves waits
        before its image): the shares alone, no forward; no outputs."""
        with torch_threads(self.threads):
            self.features.advance_slices(batch.encode_slices)
        return []

    @property
    def num_encoded_images(self) -> int:
        return self.features.num_encoded

    @property
    def encoded(self) -> dict[str, list[int]]:
        return self.features.encoded

    def release(self, request_id: str) -> None:
        """Forget a request's image features (it was preempted, or it finished), and stop the
        sliced encodes it began."""
        self.features.release(request_id)

    def close(self) -> None:
        """Stop every sliced encode (the engine is shutting down)."""
        self.features.close()


def _embed_rows(span: ImageSpan, a: int, b: int) -> tuple[torch.Tensor, int]:
    """Run positions in `[a, b)` of an image that carry embeddings (relative to the run's start),
    and the index of the first of them among the image's embeddings."""
    if span.embed_mask is None:
        return torch.arange(a, b), a
    mask = torch.tensor(span.embed_mask[:b], dtype=torch.bool)
    first = int(mask[:a].sum())
    return torch.nonzero(mask[a:b]).flatten() + a, first
