"""Where a forward may pause: before each layer of a vision tower or a language model.

Work that may pause installs a gate on its thread (a sliced image encode on a thread of its own,
vision/sliced_encode.py, which waits there for its next share; a step of background work alone,
core/background_yield.py, which runs the steps of what arrived there), and every layer loop calls
`layer_boundary()`. Anywhere else the call costs one attribute lookup.
"""

from __future__ import annotations

import threading
from typing import Protocol


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
