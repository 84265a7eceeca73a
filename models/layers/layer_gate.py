"""Where a forward may pause: before each layer of a vision tower or a language model.

Work run on a thread of its own installs a gate on that thread (a sliced image encode,
vision/sliced_encode.py; a background step that gives way to arrivals, core/yielding_step.py), and
every layer loop calls `layer_boundary()`: there the gate may hold the thread until it is let go.
Anywhere else the call costs one attribute lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Gate(Protocol):
    def wait_turn(self) -> None:
        """Return when the thread may start its next layer (or raise to unwind it)."""


_local = threading.local()


def install(gate: Gate | None) -> None:
    """The gate of the calling thread's layer loops (None: no gate)."""
    _local.gate = gate


def layer_boundary() -> None:
    """Called by a tower or a language model before each of its layers."""
    gate = getattr(_local, "gate", None)
    if gate is not None:
        gate.wait_turn()


class _Cancelled(Exception):
    """Unwinds paused work that is no longer wanted."""


class GatedWork:
    """`work()` on a thread of its own, computing only while its caller waits in `_hand_turn`: the
    two take turns and never compute at once. Before each layer the thread asks `_pause_here()`;
    where it says so, it gives the turn back and waits for the next. Subclasses say when to pause
    (after so many layers: vision/sliced_encode.py; when something arrived: core/yielding_step.py).
    """

    def __init__(self, work: Callable[[], Any], threads: int, name: str) -> None:
        self._cv = threading.Condition()
        self._turn = False  # True while the worker computes (the caller waits)
        self._cancelled = False
        self._ended = False  # the worker is past its work (done, failed or cancelled)
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work, threads), name=name, daemon=True)
        self._thread.start()  # it waits for the first turn before it computes anything

    def _pause_here(self) -> bool:
        """Called under the lock before each layer: whether to give the turn back first."""
        raise NotImplementedError

    def _layer_starts(self) -> None:
        """Called under the lock as the worker starts a layer (after a pause, if it paused)."""

    def _hand_turn(self, poll_s: float | None = None, poll: Callable[[], None] | None = None) -> bool:
        """Let the worker compute until it pauses or ends (whether it has ended). Call with the
        lock held; `poll()` runs every `poll_s` seconds meanwhile, under the lock."""
        self._turn = not self._ended
        self._cv.notify_all()
        while self._turn:
            self._cv.wait(poll_s)
            if poll is not None and self._turn:
                poll()
        return self._ended

    def result(self) -> Any:
        """What the work returned once it ended; an error it raised is raised here."""
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
            if self._pause_here():
                self._turn = False
                self._cv.notify_all()
                while not self._turn and not self._cancelled:
                    self._cv.wait()
            if self._cancelled:
                raise _Cancelled
            self._layer_starts()

    def _run(self, work: Callable[[], Any], threads: int) -> None:
        install(self)  # this thread's `layer_boundary()` calls come here
        torch.set_num_threads(threads)  # an OpenMP thread count is the thread's own
        try:
            with self._cv:
                while not self._turn and not self._cancelled:
                    self._cv.wait()
            if not self._cancelled:
                with torch.inference_mode():
                    self._result = work()
        except _Cancelled:
            pass
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc
        finally:
            with self._cv:
                self._ended = True
                self._turn = False
                self._cv.notify_all()
