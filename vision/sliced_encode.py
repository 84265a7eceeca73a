"""One image's vision-tower work spread over several engine steps.

A step that runs decodes may only encode so much (the scheduler's encoder budget). An image larger
than that was encoded whole all the same, and every running stream waited the whole tower for its
next token. A `SlicedEncode` runs the family's own `encode` for one image in a greenlet (a stack of
its own on the caller's thread) that pauses at each tower layer (every tower calls
`layer_boundary` before a layer): each `advance(layers)` switches in, lets it run that many more
layers, and gets the turn back when it pauses again. The features are those of a whole encode: the
same modules on the same rows.

Not a thread: a second thread that runs torch ops owns an OpenMP team of its own, and while it
exists, idle or not, libgomp stops spinning for the first thread's team (more threads than cores),
which made every step of the engine meanwhile (the running streams' decodes) 1.5-2x slower.
The greenlet shares the thread's torch state (grad mode, autocast, thread count), so an encode must
not hold such a context open across a layer boundary; `advance` runs it in inference mode.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from greenlet import error as greenlet_error
from greenlet import getcurrent, greenlet

from mm_engine.models.layers import layer_gate
from mm_engine.request import ImageSpan

Encode = Callable[[list[ImageSpan]], list[torch.Tensor]]  # a family's `encode`


class SlicedEncode:
    """`encode([span])` run a few tower layers at a time; `owner` is the request that started it."""

    def __init__(self, encode: Encode, span: ImageSpan, owner: str) -> None:
        self.owner = owner
        self.layers_done = 0
        self._allowed = 0  # layers the encode may still start before it pauses
        self._glet = greenlet(partial(self._run, encode, span))  # starts at the first advance()

    def advance(self, layers: int) -> torch.Tensor | None:
        """Run up to `layers` (at least one) more tower layers; what comes before the first layer
        and after the last runs with its neighbour. The image's features once it is done, else None.
        An error the encode raised is raised here."""
        if self._glet.dead:
            raise RuntimeError("advance() on a sliced encode that has ended")
        self._allowed = max(1, layers)
        self._glet.parent = getcurrent()  # a pause or the end returns here
        with torch.inference_mode():  # the caller's grad mode is the encode's (one thread's state)
            return self._glet.switch()

    def cancel(self) -> None:
        """Unwind it where it paused (one never started just never runs)."""
        if self._glet.dead:
            return
        try:
            self._glet.parent = getcurrent()
            self._glet.throw()  # GreenletExit at its pause; it ends there
        except (ValueError, greenlet_error):  # closed from another thread than the one it ran on:
            pass  # greenlet unwinds it on its own thread once it is collected

    # ---- inside the greenlet ----------------------------------------------------------------------

    def wait_turn(self) -> None:
        if self._allowed == 0:
            self._glet.parent.switch(None)  # paused: advance() returns None
        self._allowed -= 1
        self.layers_done += 1

    def _run(self, encode: Encode, span: ImageSpan) -> torch.Tensor:
        layer_gate.install(self)  # the greenlet's own context: its tower's layers pause here
        (feats,) = encode([span])
        return feats


class SlicedEncodes:
    """The images being encoded a share at a time, by content hash (the runner's)."""

    def __init__(self, encode: Encode, depth: int) -> None:
        self.encode = encode
        self.depth = depth  # layers an encode passes (`MultimodalModel.tower_depth`)
        self._begun: dict[str, SlicedEncode] = {}

    def __len__(self) -> int:
        return len(self._begun)

    def __contains__(self, key: str) -> bool:
        return key in self._begun

    def advance(self, span: ImageSpan, tokens: int, owner: str) -> torch.Tensor | None:
        """Run the share of `span`'s tower that `tokens` of its image tokens stand for (begun here
        for request `owner` if need be); its features once done, else None."""
        key = span.content_hash
        if key not in self._begun:
            self._begun[key] = SlicedEncode(self.encode, span, owner)
        try:
            feats = self._begun[key].advance(-(-self.depth * tokens // span.num_embeds))
        except BaseException:
            del self._begun[key]  # failed: a later share starts it again
            raise
        if feats is not None:
            del self._begun[key]
        return feats

    def finish(self, key: str) -> torch.Tensor:
        """Run the rest of a begun encode at once (its image is needed whole now)."""
        return self._begun.pop(key).advance(self.depth)

    def release(self, owner: str) -> None:
        """Stop the encodes `owner` began (it was preempted, or it finished)."""
        for key in [k for k, enc in self._begun.items() if enc.owner == owner]:
            self._begun.pop(key).cancel()

    def close(self) -> None:
        for enc in self._begun.values():
            enc.cancel()
        self._begun.clear()
