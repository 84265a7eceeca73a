"""The engine thread's side of AsyncLLM: it takes commands from the inbox, runs `step()`, and
sends each request's outputs back to the event loop that asked for them.

    inbox (deque + condition) --> _apply: add_processed / abort / call / stop
    _step: engine.step() -> delta outputs -> one call_soon_threadsafe per event loop per step,
           which puts each into its request's OutputCollector

Everything here runs on exactly one thread; the asyncio-facing API is in async_llm.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass

from mm_engine.core.faults import StepFailedError
from mm_engine.engine.async_types import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineStepError,
    ProcessedInputs,
)
from mm_engine.engine.output_collector import OutputCollector
from mm_engine.outputs import RequestOutput
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.scheduler import QueueFullError

logger = logging.getLogger("mm_engine.async_llm")


class EngineDeviceLost(Exception):
    """Raised inside the loop to stop it after a device fault."""


@dataclass(slots=True, eq=False)
class Stream:
    """One request's way back to its event loop, where `collector` gathers its outputs."""

    loop: asyncio.AbstractEventLoop
    collector: OutputCollector
    modality: str
    arrival_time: float
    # engine-thread side
    last_token_time: float | None = None
    in_engine: bool = False
    finished: bool = False

    def put(self, error: BaseException) -> None:
        """End the request with `error` (its consumer gets what is pending first)."""
        _call(self.loop, self.collector.put_error, error)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)


def _deliver(items: list[tuple[OutputCollector, RequestOutput]]) -> None:
    """On the event loop: one step's outputs, handed over in one callback."""
    for collector, out in items:
        collector.put(out)


@dataclass(slots=True)
class Command:
    kind: str  # "add", "abort", "call", "stop"
    request_id: str = ""
    args: tuple = ()
    error: BaseException | None = None  # for "abort": what the request's consumer gets, if anyone
    stream: Stream | None = None  # for "abort": its consumer may be gone from `_streams` already
    future: concurrent.futures.Future | None = None


class EngineLoop:
    """Mixed into AsyncLLM: the methods that run on the engine thread (and `_send`, which any
    thread may call to reach it). The state they share is set up by AsyncLLM.__init__."""

    # ---- engine thread -------------------------------------------------------------------------

    def _send(self, cmd: Command) -> None:
        with self._cond:
            if self._closed:  # the loop is gone: answer here, or the sender would wait forever
                self._refuse(cmd, EngineDeadError("the engine is not running"))
                return
            self._inbox.append(cmd)
            self._cond.notify()

    def _refuse(self, cmd: Command, error: EngineError) -> None:
        stream = self._streams.get(cmd.request_id) if cmd.kind == "add" else None
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.put(error)
        if cmd.future is not None and not cmd.future.done():
            cmd.future.set_exception(error)

    def _take(self, block: bool) -> list[Command]:
        with self._cond:
            if block and not self._inbox:
                # Wake up now and then while idle so the heartbeat shows the loop is alive.
                self._cond.wait(timeout=min(1.0, self.stall_timeout / 4))
            cmds = list(self._inbox)
            self._inbox.clear()
            return cmds

    def _run(self) -> None:
        try:
            while True:
                cmds = self._take(block=not self.engine.has_unfinished())
                stop = any(c.kind == "stop" for c in cmds)
                for cmd in cmds:
                    self._apply(cmd)
                if cmds:
                    self._stats = self.engine.stats()
                if stop:
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._heartbeat = time.monotonic()
        except EngineDeviceLost:
            pass  # logged where it happened; `_last_error` says why
        except BaseException:  # the loop itself broke: nothing can run any more
            logger.exception("engine loop died")
            self._last_error = self._last_error or "the engine loop stopped"
        finally:
            self._dead = True
            self._fail_everything(EngineDeadError("the engine stopped"))

    def _apply(self, cmd: Command) -> None:
        if cmd.kind == "add":
            self._add(cmd.request_id, *cmd.args)
        elif cmd.kind == "abort":
            stream = cmd.stream
            self.engine.abort(cmd.request_id)
            if stream is not None and not stream.finished:
                stream.finished = True
                if stream.in_engine and self.listener is not None:
                    self.listener.on_aborted(stream.modality)
                if cmd.error is not None:
                    stream.put(cmd.error)
        elif cmd.kind == "call":
            try:
                cmd.future.set_result(cmd.args[0](self.engine))
            except Exception as exc:
                cmd.future.set_exception(exc)

    def _add(self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, priority: int) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:  # aborted (client gone) before it reached us
            return
        try:
            self.engine.add_processed(
                inputs.text, inputs.token_ids, inputs.spans, params, request_id, priority
            )
        except ValueError as exc:  # the client's request cannot run: its message is for the client
            stream.finished = True
            stream.put(exc)
            return
        except QueueFullError as exc:
            stream.finished = True
            stream.put(EngineOverloadedError(str(exc)))
            return
        except Exception:
            logger.exception("adding request failed")
            stream.finished = True
            stream.put(EngineError("the engine could not accept the request"))
            return
        stream.in_engine = True

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._on_step_failure(exc)
            return
        seconds = time.perf_counter() - start
        self._last_step_failed = False
        stats = self._stats = self.engine.stats()
        if self.listener is not None:
            self.listener.on_step(seconds, len(outputs), stats)
        hand_out(self._streams, outputs, self.listener)

    def _on_step_failure(self, exc: Exception) -> None:
        # A StepFailedError names the requests the failed batch held (the engine dropped them);
        # anything else came from outside a forward (the scheduler), so every request fails.
        cause = exc.__cause__ if isinstance(exc, StepFailedError) and exc.__cause__ else exc
        logger.error("engine step failed", exc_info=cause)
        self._faults += 1
        self._last_step_failed = True
        if isinstance(exc, StepFailedError) and exc.device_lost:
            self._last_error = f"device fault ({type(cause).__name__}); the engine stopped"
            raise EngineDeviceLost from exc  # ends the loop: nothing can run on this device
        self._last_error = f"engine step failed ({type(cause).__name__})"
        failed = exc.request_ids if isinstance(exc, StepFailedError) else list(self._streams)
        for rid in failed:
            stream = self._streams.get(rid)
            if stream is not None and stream.in_engine and not stream.finished:
                self.engine.abort(rid)
                stream.finished = True
                stream.put(EngineStepError("the engine failed while running this request"))
        self._stats = self.engine.stats()

    def _fail_everything(self, error: EngineError) -> None:
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.finished = True
                stream.put(error)
        with self._cond:
            self._closed = True
            for cmd in self._inbox:
                self._refuse(cmd, error)
            self._inbox.clear()


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
