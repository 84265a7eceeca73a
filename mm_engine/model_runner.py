"""Turns one scheduled batch into tensors and runs one forward over it.

The batch is flat (varlen): the new tokens of every scheduled request one after the other, prefill
chunks and decodes together. Images whose tokens fall in this step's chunks are encoded first, in
one batch, and their features replace the image-token embeddings. Logits are computed only for the
requests whose chunk reaches their last token, i.e. the ones that sample this step.
"""

from __future__ import annotations

import torch

from mm_engine.kernels.backend import AttentionBackend
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.model import LlavaModel
from mm_engine.pools.kv_cache import KVCache
from mm_engine.request import Request
from mm_engine.vision.encoder_cache import EncoderCache


class ModelRunner:
    def __init__(
        self,
        model: LlavaModel,
        kv: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        encoder_cache: EncoderCache,
    ) -> None:
        self.model = model
        self.encoder_cache = encoder_cache
        self.kv = kv
        self.backend = backend
        self.device = device
        self.block_size = kv.spec.block_size
        self.num_encoded_images = 0  # how many images the vision tower has encoded in all

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[int]]:
        """Returns logits `[len(sampling), vocab]` (float32) and the indices into `items` they belong to."""
        self._encode_images(items)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        image_pieces: list[tuple[int, torch.Tensor]] = []  # (flat row, features)
        sample_rows: list[int] = []
        sampling: list[int] = []
        for k, (req, n) in enumerate(items):
            start, end, row0 = req.num_computed_tokens, req.num_computed_tokens + n, len(ids)
            ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            for j, span in enumerate(req.images):
                a, b = max(start, span.offset), min(end, span.offset + span.length)
                if a < b:
                    image_pieces.append(
                        (row0 + a - start, req.image_embeds[j][a - span.offset : b - span.offset])
                    )
            if end == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampling.append(k)
        meta = self._metadata(items, slots)
        lm = self.model.language_model
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        if image_pieces:
            # Image-token ids may lie outside the vocabulary; their embeddings are replaced anyway.
            # (Only prompt positions: a generated image-token id is embedded like any other token.)
            for row, feats in image_pieces:
                ids_t[row : row + feats.shape[0]] = 0
        embeds = lm.embed_tokens(ids_t)
        for row, feats in image_pieces:
            embeds[row : row + feats.shape[0]] = feats.to(embeds.dtype)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = lm(embeds, pos_t, self.kv.k, self.kv.v, meta, self.backend)
        logits = lm.logits(hidden[sample_rows]) if sample_rows else hidden.new_empty((0, 0))
        self._drop_used_images(items)
        return logits, sampling

    def _metadata(self, items: list[tuple[Request, int]], slots: list[int]) -> AttentionMetadata:
        q_lens = [n for _, n in items]
        seq_lens = [req.num_computed_tokens + n for req, n in items]
        width = max(len(req.block_table) for req, _ in items)
        tables = [req.block_table + [0] * (width - len(req.block_table)) for req, _ in items]
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32, device=dev).cumsum(
                0, dtype=torch.int32
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )

    def _encode_images(self, items: list[tuple[Request, int]]) -> None:
        """Give every image that this step's chunks touch its features: from the encoder cache, or
        encoded now in one batch (each distinct image once, however many requests carry it)."""
        todo: dict[str, list[tuple[Request, int]]] = {}
        for req, n in items:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            for j, span in enumerate(req.images):
                if span.offset < end and start < span.offset + span.length and j not in req.image_embeds:
                    feats = self.encoder_cache.get(span.content_hash)
                    if feats is not None:
                        req.image_embeds[j] = feats
                    else:
                        todo.setdefault(span.content_hash, []).append((req, j))
        if not todo:
            return
        firsts = [users[0] for users in todo.values()]
        pixels = torch.stack([req.images[j].pixel_values for req, j in firsts]).to(self.device)
        feats = self.model.encode_images(pixels)
        for (key, users), f in zip(todo.items(), feats, strict=True):
            self.encoder_cache.put(key, f)
            for req, j in users:
                req.image_embeds[j] = f
        self.num_encoded_images += len(todo)

    @staticmethod
    def _drop_used_images(items: list[tuple[Request, int]]) -> None:
        """Features are needed only until the prefill has passed the image."""
        for req, n in items:
            done = req.num_computed_tokens + n
            for j in [j for j in req.image_embeds if req.images[j].offset + req.images[j].length <= done]:
                del req.image_embeds[j]
