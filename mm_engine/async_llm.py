"""The engine behind the HTTP server: one engine thread, many asyncio clients.

    event loop (any number)                 engine thread (exactly one: LLMEngine is not thread-safe)
    generate() --add--> inbox (deque+cond) --> add_processed / abort / call
    queue.get() <--call_soon_threadsafe---- step() -> outputs per request

Tokenizing and decoding images happen in a worker pool (`process_prompt`, `process_chat`), never on
the event loop and never on the engine thread. A request whose consumer goes away (client
disconnect, cancellation) is aborted, which frees its blocks at once. An exception in `step()` fails
the requests in the engine with `EngineStepError` (their blocks are freed) and is recorded for the
health check; the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from mm_engine.async_types import (
    EngineDeadError,
    EngineDrainingError,
    EngineError,
    EngineOverloadedError,
    EngineStepError,
    Health,
    ProcessedInputs,
    StatsListener,
)
from mm_engine.config import EngineConfig
from mm_engine.engine import LLMEngine
from mm_engine.outputs import RequestOutput
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.scheduler import QueueFullError
from mm_engine.vision.image_io import ImageLimits

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Stream:
    """One request's way back to its event loop. `queue` items: RequestOutput or an exception."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    modality: str
    arrival_time: float
    # engine-thread side
    num_tokens: int = 0
    last_token_time: float | None = None
    in_engine: bool = False
    finished: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(slots=True)
class _Command:
    kind: str  # "add", "abort", "call", "stop"
    request_id: str = ""
    args: tuple = ()
    error: BaseException | None = None  # for "abort": what the request's consumer gets, if anyone
    stream: _Stream | None = None  # for "abort": its consumer may be gone from `_streams` already
    future: concurrent.futures.Future | None = None


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        image_limits: ImageLimits | None = None,
        input_workers: int = 2,
        stall_timeout: float = 60.0,
        listener: StatsListener | None = None,
    ) -> None:
        self.engine = engine
        if image_limits is not None:
            engine.inputs.limits = image_limits  # before the worker pool exists: no race
        self.stall_timeout = stall_timeout
        self.listener = listener
        self._pool = concurrent.futures.ThreadPoolExecutor(input_workers, thread_name_prefix="mm-inputs")
        self._inbox: collections.deque[_Command] = collections.deque()
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._stats: dict = engine.stats()
        self._heartbeat = time.monotonic()
        self._faults = 0
        self._last_error: str | None = None
        self._last_step_failed = False
        self._draining = False
        self._dead = False
        self._closed = False  # set by the engine thread as it exits; guarded by `_cond`
        self._thread = threading.Thread(target=self._run, name="mm-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs: Any) -> AsyncLLM:
        """`AsyncLLM.from_engine_args(model, kv_cache_memory_bytes=..., stall_timeout=...)`."""
        own = {k: kwargs.pop(k) for k in list(kwargs) if k not in EngineConfig.__dataclass_fields__}
        return cls(LLMEngine(EngineConfig.from_kwargs(model, **kwargs)), **own)

    # ---- inputs (worker pool) --------------------------------------------------------------------

    async def process_prompt(self, prompt: Any) -> ProcessedInputs:
        """Tokenize and load images of a `generate`-style prompt off the event loop."""
        return await self.run_in_worker(lambda: ProcessedInputs(*self.engine.inputs.process(prompt)))

    async def process_chat(self, messages: list[dict]) -> ProcessedInputs:
        """The same for OpenAI-style messages, through the model's chat template."""
        return await self.run_in_worker(lambda: ProcessedInputs(*self.engine.inputs.chat(messages)))

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run CPU-bound input work (decoding, encoding, tokenizing) in the worker pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- requests ----------------------------------------------------------------------------

    def check_admission(self) -> None:
        """Raise if a new request would be refused now (cheap; call before processing inputs)."""
        if self._dead:
            raise EngineDeadError("the engine is not running")
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        # The scheduler enforces the limit exactly when the request is added; this early check, on
        # the last snapshot, spares decoding the images of a request that would be refused anyway.
        limit = self.engine.config.max_waiting_requests
        if self._stats.get("num_requests_waiting", 0) >= limit:
            raise EngineOverloadedError(f"the waiting queue is full ({limit} requests)")

    async def generate(
        self,
        inputs: ProcessedInputs,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one output per generated token until the request finishes.

        Raises ValueError when the engine refuses the request (too long, does not fit the pools),
        EngineError subclasses for server-side failures. Closing the iterator early aborts it.
        """
        self.check_admission()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(
            asyncio.get_running_loop(), asyncio.Queue(), inputs.modality, arrival_time or time.time()
        )
        self._streams[request_id] = stream
        finished = False
        try:
            self._send(_Command("add", request_id, (inputs, params, priority)))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            del self._streams[request_id]

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Drop a request, freeing its blocks; its consumer (if any) gets `error`. Thread-safe."""
        self._send(_Command("abort", request_id, error=error, stream=self._streams.get(request_id)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps (after every command sent before)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Command("call", args=(fn,), future=future))
        return await asyncio.wrap_future(future)

    # ---- state -------------------------------------------------------------------------------

    def stats(self) -> dict:
        """The engine's `stats()` as of the end of the last loop iteration (safe from any thread)."""
        return self._stats

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def health(self) -> Health:
        since = time.monotonic() - self._heartbeat
        alive = self._thread.is_alive() and not self._dead
        return Health(
            alive=alive,
            draining=self._draining,
            stalled=alive and since > self.stall_timeout,
            seconds_since_progress=since,
            faults_total=self._faults,
            last_error=self._last_error,
            last_step_failed=self._last_step_failed,
            num_unfinished=len(self._streams),
        )

    # ---- shutdown ----------------------------------------------------------------------------

    def start_drain(self) -> None:
        """Refuse new requests from now on; running ones continue."""
        self._draining = True

    async def drain(self, timeout: float) -> bool:
        """Stop taking requests, wait up to `timeout` s for running ones, abort the rest.

        Returns True when everything finished in time."""
        self.start_drain()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self._streams:
            return True
        left = list(self._streams)
        logger.warning("shutdown timeout: aborting %d unfinished request(s)", len(left))
        for rid in left:
            self.abort(rid, EngineDrainingError("the server shut down before the request finished"))
        return False

    async def shutdown(self) -> None:
        """Stop the engine thread; any request still open gets EngineDeadError."""
        self._send(_Command("stop"))
        await asyncio.to_thread(self._thread.join)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread -------------------------------------------------------------------------

    def _send(self, cmd: _Command) -> None:
        with self._cond:
            if self._closed:  # the loop is gone: answer here, or the sender would wait forever
                self._refuse(cmd, EngineDeadError("the engine is not running"))
                return
            self._inbox.append(cmd)
            self._cond.notify()

    def _refuse(self, cmd: _Command, error: EngineError) -> None:
        stream = self._streams.get(cmd.request_id) if cmd.kind == "add" else None
        if stream is not None and not stream.finished:
            stream.finished = True
            stream.put(error)
        if cmd.future is not None and not cmd.future.done():
            cmd.future.set_exception(error)

    def _take(self, block: bool) -> list[_Command]:
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
        except BaseException:  # the loop itself broke: nothing can run any more
            logger.exception("engine loop died")
        finally:
            self._dead = True
            self._fail_everything(EngineDeadError("the engine stopped"))

    def _apply(self, cmd: _Command) -> None:
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
        now = time.time()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.finished:
                continue  # aborted while this step ran; its abort command is already queued
            self._account(stream, out, now)
            stream.finished = out.finished
            stream.put(out)

    def _account(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        if self.listener is None:
            return
        n = len(out.outputs[0].token_ids)
        itl = None if stream.last_token_time is None else now - stream.last_token_time
        self.listener.on_output(out, stream.modality, n - stream.num_tokens, itl)
        stream.num_tokens, stream.last_token_time = n, now
        if out.finished:
            self.listener.on_finished(out, stream.modality, stream.arrival_time)

    def _on_step_failure(self, exc: Exception) -> None:
        # Which requests the failed batch held is not visible from here, and their state may be
        # half-updated, so every request in the engine fails; aborting frees all their blocks.
        logger.error("engine step failed", exc_info=exc)
        self._faults += 1
        self._last_error = f"engine step failed ({type(exc).__name__})"
        self._last_step_failed = True
        for rid, stream in list(self._streams.items()):
            if stream.in_engine and not stream.finished:
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
