"""What every asynchronous engine offers the HTTP layer, whichever side runs the engine core.

    AsyncLLM     the core on an engine thread of this process (driver: engine_thread.py)
    AsyncMPLLM   the core in processes of their own (driver: core_processes.py)

Both take requests from any number of event loops: `process_prompt` / `process_chat` turn inputs
into token ids and pixels in worker threads, `generate` yields a request's outputs as its
`output_kind` asks, `abort` drops it (so does closing the iterator), `health` says whether the
engine makes progress, `drain` and `shutdown` end it. The driver is a component given the shared
streams and vitals (streams.py); it takes `Command`s and runs the core(s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from mm_engine.engine.async_types import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    Health,
    ModelInfo,
    ProcessedInputs,
    StatsListener,
)
from mm_engine.engine.output_collector import OutputCollector
from mm_engine.engine.streams import Command, Shared, Stream, Vitals
from mm_engine.frontend.chat_messages import TemplateChat
from mm_engine.frontend.input_lanes import InputLanes, input_weight
from mm_engine.frontend.inputs import InputProcessor
from mm_engine.outputs import RequestOutput
from mm_engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("mm_engine.async_llm")


class Driver(Protocol):
    """What runs the core(s) behind an `AsyncEngine`: an engine thread, or core processes."""

    def send(self, cmd: Command) -> None: ...
    async def kv_report(self) -> dict[str, dict]: ...
    def alive(self) -> bool: ...
    def join(self) -> None: ...


class AsyncEngine:
    def __init__(
        self,
        inputs: InputProcessor,
        model_info: ModelInfo,
        make_driver: Callable[[Shared], Driver],
        *,
        max_waiting: int,
        stats: dict,
        platform: dict,
        input_workers: int,
        light_input_bytes: int,
        stall_timeout: float,
        listener: StatsListener | None,
    ) -> None:
        """`make_driver`: builds the driver from the state it shares with this engine (called
        last, so the driver starts with everything in place)."""
        self._inputs = inputs
        self.model_info = model_info
        self.stall_timeout = stall_timeout
        self._listener = listener
        self._max_waiting = max_waiting
        self._lanes = InputLanes(input_workers, light_input_bytes)
        self._streams: dict[str, Stream] = {}
        self._vitals = Vitals(stats)
        self._platform = platform  # fixed for the engine's life
        self._draining = False
        self._driver = make_driver(Shared(self._streams, self._vitals, listener, stall_timeout))

    @property
    def listener(self) -> StatsListener | None:
        """Who receives request timings (the server's `Metrics`), given when the engine is built."""
        return self._listener

    async def kv_report(self) -> dict[str, dict]:
        return await self._driver.kv_report()

    # ---- inputs (worker pool) --------------------------------------------------------------------

    @property
    def inputs(self) -> InputProcessor:
        """What turns prompts and images into engine inputs (thread-safe: each thread has its
        own tokenizer); for `run_in_worker` jobs that need it."""
        return self._inputs

    async def process_prompt(self, prompt: Any) -> ProcessedInputs:
        """Tokenize and load images of a `generate`-style prompt off the event loop."""
        work = lambda: ProcessedInputs(*self._inputs.process(prompt))  # noqa: E731
        return await self.run_in_worker(work, weight=self._weigh(prompt))

    async def process_chat(
        self,
        messages: list[dict] | TemplateChat,
        tools: list[dict] | None = None,
        overrides: Mapping[str, Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedInputs:
        """The same for OpenAI-style messages (or the `TemplateChat` an HTTP route built), through
        the model's chat template (which also describes `tools`, when given); `overrides`: image
        processor options; `template_kwargs`: extra template variables."""
        work = lambda: ProcessedInputs(*self._inputs.chat(messages, overrides, tools, template_kwargs))  # noqa: E731
        chat = isinstance(messages, TemplateChat)
        held = (messages.messages, messages.images, messages.videos) if chat else messages
        return await self.run_in_worker(work, weight=self._weigh(held))

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any, weight: int | None = None) -> Any:
        """Run CPU-bound input work (decoding, encoding, tokenizing) in a worker: a light one when
        the work's input (`weight`, by default the arguments' size) is small, so that big inputs
        never hold up small ones."""
        return await self._lanes.run(self._weigh(args) if weight is None else weight, fn, *args)

    def _weigh(self, obj: Any) -> int:
        return input_weight(obj, limit=self._lanes.light_bytes)

    # ---- requests ----------------------------------------------------------------------------

    def check_admission(self) -> None:
        """Raise if a new request would be refused now (cheap; call before processing inputs)."""
        if self._vitals.dead:
            raise EngineDeadError("the engine is not running")
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        # The scheduler enforces the limit exactly when the request is added; this early check, on
        # the last snapshot, spares decoding the images of a request that would be refused anyway.
        limit = self._max_waiting
        if self._vitals.stats.get("num_requests_waiting", 0) >= limit:
            raise EngineOverloadedError(f"the waiting queue is full ({limit} requests)")

    async def generate(
        self,
        inputs: ProcessedInputs,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes, shaped by `params.output_kind` (CUMULATIVE:
        everything so far; DELTA: what is new; FINAL_ONLY: one output at the end). A consumer that
        reads slower than the engine generates gets what is new merged into its next output.

        Raises ValueError when the engine refuses the request (too long, does not fit the pools),
        EngineError subclasses for server-side failures. Closing the iterator early aborts it.
        """
        self.check_admission()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:  # compiled off the loop, the lanes and the engine's step
            await self._inputs.await_structured_outputs(params)
        collector = OutputCollector(params.output_kind)
        stream = Stream(asyncio.get_running_loop(), collector, inputs.modality, arrival_time or time.time())
        self._streams[request_id] = stream
        # The engine sends deltas whatever the caller asked; the collector shapes them.
        engine_params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        finished = False
        try:
            self._driver.send(Command("add", request_id, (inputs, engine_params, priority)))
            while True:
                try:
                    item = await stream.collector.get()
                except BaseException as exc:
                    finished = not isinstance(exc, asyncio.CancelledError)  # the engine dropped it
                    raise
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
        self._driver.send(Command("abort", request_id, error=error, stream=self._streams.get(request_id)))

    # ---- state -------------------------------------------------------------------------------

    def stats(self) -> dict:
        """The engine's `stats()` as of the end of the last loop iteration (safe from any thread)."""
        return self._vitals.stats

    def platform_info(self) -> dict:
        """Device, attention backend, CPU kernel variant and the kernels in use (kernels/ops.py)."""
        return self._platform

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def health(self) -> Health:
        vitals = self._vitals
        since = time.monotonic() - vitals.heartbeat
        alive = self._driver.alive() and not vitals.dead
        return Health(
            alive=alive,
            draining=self._draining,
            stalled=alive and since > self.stall_timeout,
            seconds_since_progress=since,
            faults_total=vitals.faults,
            last_error=vitals.last_error,
            last_step_failed=vitals.last_step_failed,
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
        self._driver.send(Command("stop"))
        await asyncio.to_thread(self._driver.join)
        self._lanes.shutdown()
