"""A forward that pauses before its next layer when something arrives.

A step of background work alone (the batch API's requests: sched/scheduler.py) takes a few hundred
milliseconds on a CPU, and a request arriving meanwhile used to wait for all of it. A
`YieldingStep` runs such a step's work on a thread of its own; the engine's thread waits for it and
looks at its inbox every few milliseconds (`arrivals`). When something came, the work pauses at the
next `layer_boundary()` (before a layer of the language model or of a vision tower) and `run`
returns; the engine takes the arrivals in, runs their steps, and calls `run` again to resume. The
two threads take turns and never compute at once (models/layers/layer_gate.py), so the paused
forward's KV writes, states and features are those of a forward run straight through
(core/background_yield.py keeps everything else away from its requests meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mm_engine.models.layers.layer_gate import GatedWork

POLL_S = 0.002  # how often the waiting engine thread looks for arrivals


class YieldingStep(GatedWork):
    """`work()` on a thread of its own, run by turns: see the module docstring."""

    def __init__(self, work: Callable[[], Any], threads: int) -> None:
        self.pauses = 0  # how often it gave way
        self._pause = False  # arrivals were seen: stop before the next layer
        super().__init__(work, threads, "mm-engine-yielding-step")

    def run(self, arrivals: Callable[[], bool], poll_s: float = POLL_S) -> bool:
        """Let the work compute until it is done (True) or has paused because `arrivals()` said
        something came (False). `arrivals` is called on this thread only."""

        def look() -> None:
            self._pause = self._pause or bool(arrivals())

        with self._cv:
            self._pause = bool(arrivals())  # (something already there: it pauses at its next layer)
            return self._hand_turn(poll_s, look)

    def _pause_here(self) -> bool:
        if self._pause:
            self.pauses += 1
        return self._pause
