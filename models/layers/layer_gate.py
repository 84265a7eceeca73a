"""Where a forward may pause: before each layer of a vision tower or a language model.

Work that may pause installs a gate where it runs (a sliced image encode in a greenlet of its own,
vision/sliced_encode.py, which switches back to the engine's step there; a step of background work
alone, core/background_yield.py, which runs the steps of what arrived there), and every layer loop
calls `layer_boundary()`. Anywhere else the call costs one context-variable lookup.

The gate is a context variable, not a thread-local: a greenlet starts with a context of its own, so
a tower paused in one sees its own gate while the step that runs it sees the step's.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol


class Gate(Protocol):
    def wait_turn(self) -> None:
        """Return when the forward may start its next layer (or raise to unwind it)."""


_gate: ContextVar[Gate | None] = ContextVar("mm_engine_layer_gate", default=None)


def install(gate: Gate | None) -> None:
    """The gate of the calling context's layer loops (None: no gate)."""
    _gate.set(gate)


def layer_boundary() -> None:
    """Called by a tower or a language model before each of its layers."""
    gate = _gate.get()
    if gate is not None:
        gate.wait_turn()
