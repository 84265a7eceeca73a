"""One image's vision-tower work spread over several engine steps.

A step that runs decodes may only encode so much (the scheduler's encoder budget). An image larger
than that was encoded whole all the same, and every running stream waited the whole tower for its
next token. A `SlicedEncode` runs the family's own `encode` for one image on a thread of its own
that pauses at each tower layer (every tower calls `layer_boundary` before a layer): each
`advance(layers)` lets it run that many more layers and waits until it pauses again. The two
threads take turns and never compute at once, and the features are those of a whole encode: the
same modules on the same rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from mm_engine.models.layers import layer_gate
from mm_engine.request import ImageSpan

Encode = Callable[[list[ImageSpan]], list[torch.Tensor]]  # a family's `encode`


class _Cancelled(Exception):
    """Unwinds a paused encode that is no longer wanted."""


class SlicedEncode:
    """`encode([span])` run a few tower layers at a time; `owner` is the request that started it."""

    def __init__(self, encode: Encode, span: ImageSpan, threads: int, owner: str) -> None:
        self.owner = owner
        self.layers_done = 0
        self._cv = threading.Condition()
        self._allowed = 0  # layers the worker may still start before it pauses
        self._turn = False  # True while the worker computes (the caller waits)
        self._cancelled = False
        self._ended = False  # the worker is past its encode (done, failed or cancelled)
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(encode, span, threads), name="mm-engine-sliced-encode", daemon=True
        )
        self._thread.start()  # it waits for the first advance() before it computes anything

    def advance(self, layers: int) -> torch.Tensor | None:
        """Run up to `layers` (at least one) more tower layers; what comes before the first layer
        and after the last runs with its neighbour. The image's features once it is done, else None.
        An error the encode raised is raised here."""
        with self._cv:
            self._allowed = max(1, layers)
            self._turn = not self._ended
            self._cv.notify_all()
            while self._turn:
                self._cv.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop it where it paused and let its thread end."""
        with self._cv:
            self._cancelled = True
            self._cv.notify_all()
        self._thread.join()

    # ---- the worker's side ----------------------------------------------------------------------

    def wait_turn(self) -> None:
        with self._cv:
            if self._allowed == 0:
                self._turn = False
                self._cv.notify_all()
                while not self._turn and not self._cancelled:
                    self._cv.wait()
            if self._cancelled:
                raise _Cancelled
            self._allowed -= 1
            self.layers_done += 1

    def _run(self, encode: Encode, span: ImageSpan, threads: int) -> None:
        layer_gate.install(self)  # the tower's `layer_boundary()` calls pause here
        torch.set_num_threads(threads)  # an OpenMP thread count is the thread's own
        try:
            with self._cv:
                while not self._turn and not self._cancelled:
                    self._cv.wait()
            if not self._cancelled:
                with torch.inference_mode():
                    (self._result,) = encode([span])
        except _Cancelled:
            pass
        except BaseException as exc:  # handed to the caller by advance()
            self._error = exc
        finally:
            with self._cv:
                self._ended = True
                self._turn = False
                self._cv.notify_all()


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
        if key not in self._begun:  # torch threads: the caller's (the runner's, inside its prepare)
            self._begun[key] = SlicedEncode(self.encode, span, torch.get_num_threads(), owner)
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
