"""The vision tower data-parallel over the tensor-parallel ranks (`mm_encoder_tp_mode="data"`).

Every rank holds the whole tower. When a step encodes two images or more, rank 0 splits them into
one share per rank, balanced by pixels; each worker gets an `Encode` header over its pipe and its
images' tensors point to point, every rank encodes its share at the same time, and the features
are gathered on rank 0 (padded to the largest share), which caches them and hands them to the
step like features it encoded itself. One image is encoded on rank 0 alone, as in the "rank0"
mode, where the workers hold no tower at all. A share that fails to encode fails the step's batch,
as an encode on rank 0 does, and every rank still joins the gathers, so the group goes on.

The turn (`TensorParallel.turn`) makes an encode's messages and collectives one unit that a
forward's cannot interleave with: with the thread launcher a forward runs beside the host.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from mm_engine.models.interface import MultimodalModel
from mm_engine.parallel.group import TPGroup
from mm_engine.parallel.step_wire import DTYPES, Encode, ImageSpec, TensorSpec, write
from mm_engine.request import ImageSpan

if TYPE_CHECKING:
    from mm_engine.parallel.executor import TensorParallel

logger = logging.getLogger("mm_engine.parallel")


def split_images(images: list[ImageSpan], world: int) -> list[list[int]]:
    """Indices of `images` per rank, in their order within a share: the largest first, each to
    the share with the fewest pixels so far (rank 0 on a tie)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(images)), key=lambda i: -images[i].pixel_values.numel()):
        r = loads.index(min(loads))
        loads[r] += images[i].pixel_values.numel()
        shares[r].append(i)
    return [sorted(s) for s in shares]


class EncodeError(RuntimeError):
    """A worker's share of a step's images failed to encode (the worker says why in its log)."""


class DataParallelEncoder:
    """Rank 0's `encode` (ModelRunner.encoder) when every rank holds the tower."""

    def __init__(self, model: MultimodalModel, parallel: TensorParallel) -> None:
        self.model = model
        self.parallel = parallel
        emb = model.language_model.embed_tokens
        self.feature = [1 + model.num_deepstack, emb.embedding_dim]
        self.dtype = emb.weight.dtype
        self.images_per_rank = [0] * parallel.world  # how many images each rank has encoded

    def __call__(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        if len(images) < 2:
            self.images_per_rank[0] += len(images)
            return self.model.encode(images)
        shares = split_images(images, self.parallel.world)
        for rank, share in enumerate(shares):
            self.images_per_rank[rank] += len(share)
        rows = max(sum(images[i].num_embeds for i in share) for share in shares)
        group = self.parallel.group
        with self.parallel.turn:
            try:
                for rank, share in enumerate(shares[1:], start=1):
                    share_images = [images[i] for i in share]
                    self.parallel.tell(
                        rank, lambda pipe, s=share_images, r=rank: self._send(pipe, s, rows, r)
                    )
                own = [images[i] for i in shares[0]]
                padded, error = _encode_padded(self.model, own, rows, self.feature, self.dtype, group.device)
                parts = group.gather_first(padded)
                failed = group.gather_first(_failed_flag(error, group.device))
            except Exception as exc:  # a send or a gather: the group is out of step
                raise self.parallel.broken(exc) from exc
        if error is not None:
            raise error
        bad = [rank for rank, flag in enumerate(failed) if int(flag.item())]
        if bad:  # a batch that fails, as on rank 0: the engine goes on with the other requests
            raise EncodeError(
                f"tensor-parallel rank(s) {bad} could not encode their share of the step's images"
            )
        out: list[torch.Tensor | None] = [None] * len(images)
        for share, part in zip(shares, parts, strict=True):
            at = 0
            for i in share:
                n = images[i].num_embeds
                out[i] = part[at : at + n]
                at += n
        return out  # type: ignore[return-value]

    def _send(self, pipe, images: list[ImageSpan], rows: int, rank: int) -> None:
        specs = [
            ImageSpec(_spec(s.pixel_values), None if s.grid is None else list(s.grid), s.num_embeds)
            for s in images
        ]
        write(pipe, Encode(specs, rows, self.feature, str(self.dtype)))
        group = self.parallel.group
        for s in images:
            group.send(s.pixel_values.to(group.device), rank)


def encode_share(msg: Encode, model: MultimodalModel, group: TPGroup) -> None:
    """A worker: receive its images, encode them, hand the features to rank 0."""
    images = []
    for spec in msg.images:
        pixels = _recv(spec.pixel_values, group)
        grid = None if spec.grid is None else tuple(spec.grid)
        images.append(ImageSpan(0, spec.num_embeds, pixels, "", None, spec.num_embeds, grid))
    padded, error = _encode_padded(model, images, msg.rows, msg.feature, DTYPES[msg.dtype], group.device)
    if error is not None:
        logger.error("encoding %d image(s) failed: %s", len(images), error)
    group.gather_first(padded)
    group.gather_first(_failed_flag(error, group.device))


def _encode_padded(
    model: MultimodalModel, images: list[ImageSpan], rows: int, feature: list[int], dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, Exception | None]:  # fmt: skip
    """A share's features as `[rows, *feature]`; zeros and the error where its encode failed: a
    rank joins the gathers either way, or the others would wait for it."""
    try:
        return _pad(model.encode(images) if images else [], rows, feature, dtype, device), None
    except Exception as exc:  # noqa: BLE001 - reported after the gathers
        return torch.zeros((rows, *feature), dtype=dtype, device=device), exc


def _failed_flag(error: Exception | None, device: torch.device) -> torch.Tensor:
    return torch.tensor([int(error is not None)], device=device)


def _pad(
    feats: list[torch.Tensor], rows: int, feature: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A share's features one after the other, as `[rows, *feature]`."""
    out = torch.zeros((rows, *feature), dtype=dtype, device=device)
    at = 0
    for f in feats:
        out[at : at + f.shape[0]] = f
        at += f.shape[0]
    return out


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec("", str(t.dtype), list(t.shape))


def _recv(spec: TensorSpec, group: TPGroup) -> torch.Tensor:
    t = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=group.device)
    group.recv(t)
    return t
