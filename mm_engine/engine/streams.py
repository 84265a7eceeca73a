"""What an async engine and the thread(s) driving its core(s) share: each request's way back to
its event loop (`Stream`), the commands sent to a driver (`Command`), what the health check reads
(`Vitals`), and the hand-over of one step's outputs to their event loops (`hand_out`).

Plain data: the async engine (mm_engine/async_llm.py) makes them, the driver (engine_thread.py or
core_processes.py) is given them when it is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from dataclasses import dataclass, field

from mm_engine.engine.async_types import StatsListener
from mm_engine.engine.output_collector import OutputCollector
from mm_engine.outputs import RequestOutput


@dataclass(slots=True, eq=False)
class Stream:
    """One request's way back to its event loop, where `collector` gathers its outputs."""

    loop: asyncio.AbstractEventLoop
    collector: OutputCollector
    modality: str
    arrival_time: float
    # driver side
    last_token_time: float | None = None
    in_engine: bool = False
    finished: bool = False

    def put(self, error: BaseException) -> None:
        """End the request with `error` (its consumer gets what is pending first)."""
        _call(self.loop, self.collector.put_error, error)

    def finish(self, error: BaseException | None = None) -> None:
        """Mark it ended (once); its consumer gets `error`, if one is given."""
        if not self.finished:
            self.finished = True
            if error is not None:
                self.put(error)


@dataclass(slots=True)
class Command:
    kind: str  # "add", "abort", "call", "stop"
    request_id: str = ""
    args: tuple = ()
    error: BaseException | None = None  # for "abort": what the request's consumer gets, if anyone
    stream: Stream | None = None  # for "abort": its consumer may be gone from the streams already
    future: concurrent.futures.Future | None = None


@dataclass(slots=True)
class Vitals:
    """What `health()` and `stats()` read, written by the driver's thread(s)."""

    stats: dict
    heartbeat: float = field(default_factory=time.monotonic)
    faults: int = 0
    last_error: str | None = None
    last_step_failed: bool = False
    dead: bool = False  # nothing can run any more (every core is down)


@dataclass(slots=True)
class Shared:
    """Everything a driver gets from its async engine."""

    streams: dict[str, Stream]
    vitals: Vitals
    listener: StatsListener | None  # the engine's, fixed when it is built
    stall_timeout: float


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)


def _deliver(items: list[tuple[OutputCollector, RequestOutput]]) -> None:
    """On the event loop: one step's outputs, handed over in one callback."""
    for collector, out in items:
        collector.put(out)


def hand_out(streams: dict[str, Stream], outputs: list[RequestOutput], listener) -> None:
    """One step's outputs to their streams: one hand-over per event loop (from any thread)."""
    now = time.time()
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is None or stream.finished:
            continue  # aborted while this step ran; its abort command is already queued
        if listener is not None:
            _account(listener, stream, out, now)
        stream.finished = out.finished
        by_loop.setdefault(stream.loop, []).append((stream.collector, out))
    for loop, items in by_loop.items():
        _call(loop, _deliver, items)


def _account(listener, stream: Stream, out: RequestOutput, now: float) -> None:
    itl = None if stream.last_token_time is None else now - stream.last_token_time
    listener.on_output(out, stream.modality, len(out.outputs[0].token_ids), itl)  # a delta
    stream.last_token_time = now
    if out.finished:
        listener.on_finished(out, stream.modality, stream.arrival_time)
