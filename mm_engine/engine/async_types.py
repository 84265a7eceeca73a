"""The vocabulary shared by `AsyncLLM` and the HTTP layer: its errors, processed inputs, health
and the listener that receives timings for metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mm_engine.outputs import RequestOutput
from mm_engine.request import ImageSpan


class EngineError(RuntimeError):
    """The engine could not run a request for a reason that is not the client's (HTTP 5xx)."""


class EngineStepError(EngineError):
    """A forward step failed while this request was in the engine; the request was dropped."""


class EngineDeadError(EngineError):
    """The engine loop has stopped (crashed or shut down); nothing more can run."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineDrainingError(EngineError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass(slots=True)
class ProcessedInputs:
    """What `InputProcessor` returns: the prompt text, its ids with image tokens expanded, images."""

    text: str | None
    token_ids: list[int]
    spans: list[ImageSpan]

    @property
    def modality(self) -> str:
        return "image" if self.spans else "text"


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the API needs to know of the engine's model and limits (fixed for its life)."""

    max_model_len: int
    max_num_seqs: int
    tool_format: str | None = (
        None  # how the model writes tool calls (mm_engine.frontend.tool_calls); None: it cannot
    )


@dataclass(slots=True)
class Health:
    alive: bool  # the engine thread runs
    draining: bool
    stalled: bool  # busy, yet no loop iteration finished for `stall_timeout` seconds
    seconds_since_progress: float
    faults_total: int
    last_error: str | None  # the kind of the last step failure, never its message
    last_step_failed: bool
    num_unfinished: int

    @property
    def ok(self) -> bool:
        return self.alive and not self.draining and not self.stalled and not self.last_step_failed

    @property
    def status(self) -> str:
        if not self.alive:
            return "dead"
        if self.draining:
            return "draining"
        if self.stalled:
            return "stalled"
        return "faulted" if self.last_step_failed else "ok"


class StatsListener(Protocol):
    """Receives timings from the engine thread (must be thread-safe, e.g. prometheus metrics)."""

    def on_step(self, seconds: float, num_outputs: int, stats: dict) -> None: ...

    def on_output(self, out: RequestOutput, modality: str, new_tokens: int, itl: float | None) -> None: ...

    def on_finished(self, out: RequestOutput, modality: str, arrival_time: float) -> None: ...

    def on_aborted(self, modality: str) -> None: ...
