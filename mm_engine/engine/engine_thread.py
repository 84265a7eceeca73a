"""The driver of an in-process core: one engine thread takes commands from its inbox, runs
`LLMEngine.step()`, and sends each request's outputs back to the event loop that asked for them.

    inbox (deque + condition) --> _apply: add_processed / abort / call / stop
    _step: engine.step() -> delta outputs -> one call_soon_threadsafe per event loop per step,
           which puts each into its request's OutputCollector

Everything below `send` runs on that one thread (LLMEngine is not thread-safe). A step that fails
fails the requests it held with `EngineStepError` (their blocks are freed) and is recorded for the
health check; the loop keeps serving the others. A device fault stops the loop: every request
gets `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mm_engine.core.faults import StepFailedError
from mm_engine.engine.async_types import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineStepError,
    ProcessedInputs,
)
from mm_engine.engine.llm_engine import LLMEngine
from mm_engine.engine.streams import Command, Shared, hand_out
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.scheduler import QueueFullError

logger = logging.getLogger("mm_engine.async_llm")


class EngineDeviceLost(Exception):
    """Raised inside the loop to stop it after a device fault."""


class EngineThread:
    def __init__(self, engine: LLMEngine, shared: Shared) -> None:
        self.engine = engine
        self.shared = shared
        self._inbox: collections.deque[Command] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False  # set by the engine thread as it exits; guarded by `_cond`
        self._thread = threading.Thread(target=self._run, name="mm-engine-loop", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------

    def send(self, cmd: Command) -> None:
        with self._cond:
            if self._closed:  # the loop is gone: answer here, or the sender would wait forever
                self._refuse(cmd, EngineDeadError("the engine is not running"))
                return
            self._inbox.append(cmd)
            self._cond.notify()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (after every command sent before)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.send(Command("call", args=(fn,), future=future))
        return await asyncio.wrap_future(future)

    async def kv_report(self) -> dict[str, dict]:
        return await self.call(lambda engine: engine.kv_report())

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    # ---- engine thread -------------------------------------------------------------------------

    def _refuse(self, cmd: Command, error: EngineError) -> None:
        stream = self.shared.streams.get(cmd.request_id) if cmd.kind == "add" else None
        if stream is not None:
            stream.finish(error)
        if cmd.future is not None and not cmd.future.done():
            cmd.future.set_exception(error)

    def _take(self, block: bool) -> list[Command]:
        with self._cond:
            if block and not self._inbox:
                # Wake up now and then while idle so the heartbeat shows the loop is alive.
                self._cond.wait(timeout=min(1.0, self.shared.stall_timeout / 4))
            cmds = list(self._inbox)
            self._inbox.clear()
            return cmds

    def _run(self) -> None:
        vitals = self.shared.vitals
        try:
            while True:
                cmds = self._take(block=not self.engine.has_unfinished())
                stop = any(c.kind == "stop" for c in cmds)
                for cmd in cmds:
                    self._apply(cmd)
                if cmds:
                    vitals.stats = self.engine.stats()
                if stop:
                    break
                if self.engine.has_unfinished():
                    self._step()
                vitals.heartbeat = time.monotonic()
        except EngineDeviceLost:
            pass  # logged where it happened; `last_error` says why
        except BaseException:  # the loop itself broke: nothing can run any more
            logger.exception("engine loop died")
            vitals.last_error = vitals.last_error or "the engine loop stopped"
        finally:
            vitals.dead = True
            self._fail_everything(EngineDeadError("the engine stopped"))

    def _apply(self, cmd: Command) -> None:
        if cmd.kind == "add":
            self._add(cmd.request_id, *cmd.args)
        elif cmd.kind == "abort":
            stream = cmd.stream
            self.engine.abort(cmd.request_id)
            if stream is not None and not stream.finished:
                listener = self.shared.listener
                if stream.in_engine and listener is not None:
                    listener.on_aborted(stream.modality)
                stream.finish(cmd.error)
        elif cmd.kind == "call":
            try:
                cmd.future.set_result(cmd.args[0](self.engine))
            except Exception as exc:
                cmd.future.set_exception(exc)

    def _add(self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, priority: int) -> None:
        stream = self.shared.streams.get(request_id)
        if stream is None or stream.finished:  # aborted (client gone) before it reached us
            return
        try:
            self.engine.add_processed(
                inputs.text, inputs.token_ids, inputs.spans, params, request_id, priority
            )
        except ValueError as exc:  # the client's request cannot run: its message is for the client
            stream.finish(exc)
            return
        except QueueFullError as exc:
            stream.finish(EngineOverloadedError(str(exc)))
            return
        except Exception:
            logger.exception("adding request failed")
            stream.finish(EngineError("the engine could not accept the request"))
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
        vitals, listener = self.shared.vitals, self.shared.listener
        vitals.last_step_failed = False
        stats = vitals.stats = self.engine.stats()
        if listener is not None:
            listener.on_step(seconds, len(outputs), stats)
        hand_out(self.shared.streams, outputs, listener)

    def _on_step_failure(self, exc: Exception) -> None:
        # A StepFailedError names the requests the failed batch held (the engine dropped them);
        # anything else came from outside a forward (the scheduler), so every request fails.
        cause = exc.__cause__ if isinstance(exc, StepFailedError) and exc.__cause__ else exc
        logger.error("engine step failed", exc_info=cause)
        vitals = self.shared.vitals
        vitals.faults += 1
        vitals.last_step_failed = True
        if isinstance(exc, StepFailedError) and exc.device_lost:
            vitals.last_error = f"device fault ({type(cause).__name__}); the engine stopped"
            raise EngineDeviceLost from exc  # ends the loop: nothing can run on this device
        vitals.last_error = f"engine step failed ({type(cause).__name__})"
        failed = exc.request_ids if isinstance(exc, StepFailedError) else list(self.shared.streams)
        for rid in failed:
            stream = self.shared.streams.get(rid)
            if stream is not None and stream.in_engine and not stream.finished:
                self.engine.abort(rid)
                stream.finish(EngineStepError("the engine failed while running this request"))
        vitals.stats = self.engine.stats()

    def _fail_everything(self, error: EngineError) -> None:
        for stream in list(self.shared.streams.values()):
            stream.finish(error)
        with self._cond:
            self._closed = True
            for cmd in self._inbox:
                self._refuse(cmd, error)
            self._inbox.clear()
