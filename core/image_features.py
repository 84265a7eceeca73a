"""The image features a model runner hands its forwards, kept as the scheduler's batches say.

Per batch: the shares of images encoded a few tower layers a step (`encode_slices`,
vision/sliced_encode.py) run first, and an image done goes into the encoder cache; then every image
the batch's chunks reach for the first time (`new_images`) gets its features, from the encoder cache
or encoded now in one call (each distinct image once; one begun in shares is finished instead).
They are held per request until the batch whose chunk passes the image (`passed_images`), and
dropped when the core releases the request (preempted, or finished).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mm_engine.request import ImageSpan, Request
from mm_engine.vision.encoder_cache import EncoderCache
from mm_engine.vision.sliced_encode import SlicedEncodes


class ImageFeatures:
    def __init__(
        self, encoder: Callable[[list[ImageSpan]], list[torch.Tensor]], cache: EncoderCache, tower_depth: int
    ) -> None:
        self.encoder = encoder
        self.cache = cache
        self.slices = SlicedEncodes(encoder, tower_depth)  # images encoded a share a step
        # request id -> image index -> features, for the images a request's prefill has reached
        # but not passed.
        self.held: dict[str, dict[int, torch.Tensor]] = {}
        self.num_encoded = 0  # images (clips too) the vision tower has encoded in all
        self.encoded = {"image": [0, 0], "video": [0, 0]}  # per modality: inputs, vision tokens

    def advance_slices(self, slices: list[tuple[Request, int, int]]) -> None:
        """Run each image's share of its tower; an image done goes into the encoder cache, where
        the scheduler finds it for its request's next chunk."""
        for req, j, tokens in slices:
            span = req.images[j]
            key = span.content_hash
            if self.cache.contains(key):  # done already (a step scheduled before it was)
                continue
            feats = self.slices.advance(span, tokens, req.request_id)
            if feats is not None:
                self.cache.put(key, feats)
                self._count(span)

    def take_new(self, images: list[tuple[Request, int]]) -> None:
        """Hold the features of each image the batch lists as new: from the encoder cache, or
        encoded now in one call (each distinct image once, however many requests carry it)."""
        todo: dict[str, list[tuple[Request, int]]] = {}
        for req, j in images:
            span = req.images[j]
            feats = self.cache.get(span.content_hash)
            if feats is not None:
                self.held.setdefault(req.request_id, {})[j] = feats
            else:
                todo.setdefault(span.content_hash, []).append((req, j))
        if not todo:
            return
        firsts = [users[0] for users in todo.values()]
        # One begun a share at a time is finished; the rest are encoded together.
        begun = {key: self.slices.finish(key) for key in todo if key in self.slices}
        whole = [(req, j) for (req, j), key in zip(firsts, todo, strict=True) if key not in begun]
        encoded = iter(self.encoder([req.images[j] for req, j in whole]) if whole else [])
        for key, users in todo.items():
            f = begun[key] if key in begun else next(encoded)
            self.cache.put(key, f)
            for req, j in users:
                self.held.setdefault(req.request_id, {})[j] = f
        for req, j in firsts:
            self._count(req.images[j])

    def get(self, request_id: str, j: int) -> torch.Tensor:
        return self.held[request_id][j]

    def drop_passed(self, passed: list[tuple[str, int]]) -> None:
        """Forget the images the batch's chunks passed (the step's inputs hold what it needs)."""
        for rid, j in passed:
            held = self.held.get(rid)
            if held is not None:
                held.pop(j, None)
                if not held:
                    del self.held[rid]

    def release(self, request_id: str) -> None:
        """Forget a request's features and stop the sliced encodes it began."""
        self.held.pop(request_id, None)
        self.slices.release(request_id)

    def close(self) -> None:
        self.slices.close()

    def _count(self, span: ImageSpan) -> None:
        self.num_encoded += 1
        counts = self.encoded["video" if span.video else "image"]
        counts[0] += 1
        counts[1] += span.num_embeds
