"""Image pixels cross to the engine-core process once per content hash.

The frontend's `PixelLedger` remembers which hashes' pixels it has sent (least recently used
first, up to a byte budget); for those it sends the hash alone. When it lets one go, it says so in
its next `Add`, and the core's `PixelStore`, which mirrors the ledger message by message, drops
it. Requests that still need those pixels hold their own reference, so nothing in flight breaks.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from mm_engine.core.messages import Add, ImageMsg, TensorMsg
from mm_engine.core.types import CoreRequest
from mm_engine.request import ImageSpan


class PixelLedger:
    """Frontend side: which pixels the core holds."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[str, int] = OrderedDict()  # hash -> bytes
        self.used_bytes = 0
        self.sent_bytes = 0  # pixels that crossed, in all
        self.saved_bytes = 0  # pixels that did not cross because the core had them

    def held_bytes(self, spans: list[ImageSpan]) -> int:
        """Bytes of these images' pixels the core holds already (for routing by affinity)."""
        return sum(self._held.get(span.content_hash, 0) for span in spans)

    def plan(self, spans: list[ImageSpan]) -> tuple[list[bool], list[str]]:
        """Which of one request's images must carry their pixels (the core does not hold them),
        and the hashes the core may now forget. Cheap: the copying is `image_messages`'."""
        send = []
        for span in spans:
            size = span.pixel_values.numel() * span.pixel_values.element_size()
            key = span.content_hash
            if key in self._held:
                self._held.move_to_end(key)
                self.saved_bytes += size
                send.append(False)
            else:
                self._held[key] = size
                self.used_bytes += size
                self.sent_bytes += size
                send.append(True)
        keep = {span.content_hash for span in spans}
        forget = []
        for key in list(self._held):
            if self.used_bytes <= self.capacity_bytes:
                break
            if key not in keep:
                self.used_bytes -= self._held.pop(key)
                forget.append(key)
        return send, forget


def image_messages(spans: list[ImageSpan], send: list[bool]) -> list[ImageMsg]:
    """The images of one request as messages, with their pixels where `send` says."""
    msgs = []
    for span, with_pixels in zip(spans, send, strict=True):
        pixels = TensorMsg.of(span.pixel_values) if with_pixels else None
        embed_mask = None if span.embed_mask is None else list(span.embed_mask)
        grid = None if span.grid is None else list(span.grid)
        msgs.append(
            ImageMsg(
                span.offset,
                span.length,
                span.content_hash,
                span.num_embeds,
                embed_mask,
                grid,
                pixels,
                span.temporal_step,
                span.video,
                span.time_offset,
            )  # fmt: skip
        )
    return msgs


class PixelStore:
    """Core side: the pixels the ledger says the core holds."""

    def __init__(self) -> None:
        self._pixels: dict[str, torch.Tensor] = {}  # hash -> pixel_values

    def __len__(self) -> int:
        return len(self._pixels)

    def spans(self, images: list[ImageMsg], forget: list[str]) -> list[ImageSpan]:
        out = []
        for m in images:
            if m.pixels is not None:
                self._pixels[m.content_hash] = m.pixels.tensor()
            pixels = self._pixels[m.content_hash]  # KeyError: the frontend broke the protocol
            embed_mask = None if m.embed_mask is None else tuple(m.embed_mask)
            grid = None if m.grid is None else tuple(m.grid)
            key = m.content_hash
            out.append(
                ImageSpan(
                    m.offset,
                    m.length,
                    pixels,
                    key,
                    embed_mask,
                    m.num_embeds,
                    grid,
                    m.temporal_step,
                    m.video,
                    m.time_offset,
                )  # fmt: skip
            )
        for key in forget:
            self._pixels.pop(key, None)
        return out


def add_message(request: CoreRequest, plan: tuple[list[bool], list[str]], frontend: int = 0) -> Add:
    """A request as the `Add` a core process takes, its images' pixels sent where the ledger's
    `plan` for it says that core does not hold them yet."""
    send, forget = plan
    images = image_messages(request.images, send)
    eos = sorted(request.eos_token_ids)
    return Add(request.request_id, request.token_ids, images, request.params, eos, request.priority,
               request.arrival_time, forget, frontend)  # fmt: skip
