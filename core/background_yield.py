"""Steps of background work alone that give way to arrivals: the engine core's side of
core/yielding_step.py.

    nothing paused:  schedule -> background work alone? run it yielding (it may pause: no outputs)
    a step paused:   schedule foreground work only, holding the paused step's requests
                     -> run that batch if there is one, else resume the paused step
                     (resumed to its end first when a foreground request could not be admitted
                     beside it: its requests' seats and blocks may be what that one waits for)

A request that arrives while a batch's step runs then waits for one layer of it, not all of it. The
paused step's requests are held: the scheduler neither schedules nor preempts them (their blocks
are still being written), an abort of one waits until the step ends, and no background work is
scheduled around it. Only in the plain loop (not with async scheduling), on one rank (a
tensor-parallel forward's workers wait inside it), and where the driver says how it sees arrivals
(`arrivals`: the core process's socket, the engine thread's inbox).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mm_engine.core.types import CoreOutput
from mm_engine.core.yielding_step import YieldingStep
from mm_engine.request import Request
from mm_engine.sched.scheduler import ScheduledBatch


@dataclass(slots=True)
class PausedStep:
    batch: ScheduledBatch
    work: YieldingStep
    held: frozenset[str]  # the ids of the requests it works for
    start: float  # perf_counter when it began
    aborted: list[Request] = field(default_factory=list)  # aborted meanwhile: they end with it
    in_way: bool = False  # a foreground request waits for its requests' seats or blocks


class YieldingSteps:
    """EngineCore's steps around a paused one (the scheduler, the runner are the core's)."""

    # Set by the driver: whether anything (a request, an abort) arrived since it last looked.
    arrivals: Callable[[], bool] | None = None
    _paused: PausedStep | None = None

    def _yields(self, batch: ScheduledBatch) -> bool:
        return (
            self.background_yield
            and self.arrivals is not None
            and batch.background_only
            and bool(batch.items)
        )

    def _start_yielding(self, batch: ScheduledBatch) -> list[CoreOutput]:
        work = YieldingStep(lambda: self.runner.execute(batch), torch.get_num_threads())
        held = frozenset(req.request_id for req in batch.requests)
        self._paused = PausedStep(batch, work, held, time.perf_counter())
        return self._resume()

    def _resume(self) -> list[CoreOutput]:
        """Run the paused step on until it ends (its outputs) or pauses again (none)."""
        paused = self._paused
        # (Run to its end, whatever arrives, when a foreground request waits for its requests.)
        if not paused.work.run(_nothing if paused.in_way else self.arrivals):
            return []
        self._paused = None
        skip = {req.request_id for req in paused.aborted}
        try:
            logits, sampling, prompt_rows = paused.work.result()
        except Exception as exc:
            self._end_aborted(paused)
            live = [req.request_id for req in paused.batch.requests if req.request_id not in skip]
            raise self._failed(exc, live) from exc
        if paused.work.pauses == 0:  # (a step that paused took longer than its work)
            self.scheduler.observe_step(paused.batch, time.perf_counter() - paused.start)
        outputs = self._complete(paused.batch, logits, sampling, prompt_rows, skip)
        self._end_aborted(paused)
        return outputs

    def _held_abort(self, req: Request) -> bool:
        """Whether `req`'s abort waits for the paused step (which still writes its blocks)."""
        if self._paused is None or req.request_id not in self._paused.held:
            return False
        self._paused.aborted.append(req)
        return True

    def _end_aborted(self, paused: PausedStep) -> None:
        for req in paused.aborted:
            self._finish(req, "abort")

    def _cancel_paused(self) -> None:
        """Stop a paused step (the engine is closing; its requests end with it)."""
        if self._paused is not None:
            self._paused.work.cancel()
            self._paused = None


def _nothing() -> bool:
    return False
