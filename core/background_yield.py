"""Steps of background work alone that give way to arrivals.

A step of background work alone (the batch API's requests: sched/scheduler.py) takes a few hundred
milliseconds on a CPU, and a request arriving meanwhile used to wait for all of it. Now, before
each layer of its language model or vision tower (`layer_boundary()`, models/layers/layer_gate.py),
such a step asks the driver whether anything arrived (`arrivals`: the core process's socket), and if
so hands it the turn (`yield_to`): the driver takes the arrivals in and runs foreground steps
(`step_beside`) until none is left, and the paused step goes on where it stopped.

    step_beside():  schedule foreground work only, holding the paused step's requests
                    -> run that batch; None when there is none (the paused step goes on)

The steps beside run on the same thread, inside the paused forward's call (a second thread with a
thread pool of its own made every step of the first one slower: libgomp throttles its spinning
when it manages more threads than there are cores). The paused step's requests are held: the
scheduler neither schedules nor preempts them (their blocks are still being written), an abort of
one waits until the step ends, and no other background work runs beside it. When a foreground
request cannot be admitted beside it (the seats or blocks it needs may be the paused step's), the
step runs to its end first. Only in the plain loop (not with async scheduling) and on one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mm_engine.core.types import CoreOutput
from mm_engine.models.layers import layer_gate
from mm_engine.request import Request
from mm_engine.sched.scheduler import ScheduledBatch


@dataclass(slots=True)
class PausedStep:
    batch: ScheduledBatch
    held: frozenset[str]  # the ids of the requests it works for
    aborted: list[Request] = field(default_factory=list)  # aborted meanwhile: they end with it
    in_way: bool = False  # a foreground request waits for its requests' seats or blocks
    pauses: int = 0  # how often it gave way
    giving_way: bool = False  # the steps beside it run now (their layers do not pause again)


class YieldingSteps:
    """EngineCore's side (the scheduler and the runner are the core's)."""

    # Set by the driver: whether anything (a request, an abort) arrived since it last looked, and
    # what takes it in and runs `step_beside()` until that returns None.
    arrivals: Callable[[], bool] | None = None
    yield_to: Callable[[], None] | None = None
    _paused: PausedStep | None = None

    def _yields(self, batch: ScheduledBatch) -> bool:
        driven = self.background_yield and self.arrivals is not None and self.yield_to is not None
        return driven and batch.background_only and bool(batch.items)

    def _run_yielding(self, batch: ScheduledBatch) -> tuple[list[CoreOutput], bool]:
        """`_run(batch)`, giving way at its layers (and whether it did); the requests aborted
        meanwhile end after it."""
        paused = self._paused = PausedStep(batch, frozenset(req.request_id for req in batch.requests))
        layer_gate.install(self)
        try:
            return self._run(batch), paused.pauses > 0
        finally:
            layer_gate.install(None)
            self._paused = None
            for req in paused.aborted:
                self._finish(req, "abort")

    def wait_turn(self) -> None:
        """The paused step's layer gate: give way to what arrived."""
        paused = self._paused
        if paused is None or paused.giving_way or paused.in_way or not self.arrivals():
            return
        paused.pauses += 1
        paused.giving_way = True
        try:
            self.yield_to()
        finally:
            paused.giving_way = False

    def step_beside(self) -> list[CoreOutput] | None:
        """One step of foreground work beside the paused step, or None when there is none (or a
        foreground request waits for what the paused step's requests hold)."""
        paused = self._paused
        if paused is None or paused.in_way:
            return None
        ended = self._admit_compiled() if self._compiling else []  # grammars that failed
        batch = self._schedule(paused.held)
        paused.in_way = batch.held_in_way
        if not batch.items and not batch.encode_slices:
            return ended or None
        return ended + self._run_batch(batch)

    def _held_abort(self, req: Request) -> bool:
        """Whether `req`'s abort waits for the paused step (which still writes its blocks)."""
        if self._paused is None or req.request_id not in self._paused.held:
            return False
        self._paused.aborted.append(req)
        return True

    def _skipped(self) -> set[str] | None:
        """Requests that sample nothing: those aborted while the step was paused."""
        return {req.request_id for req in self._paused.aborted} if self._paused is not None else None
