"""`AsyncMPLLM`: the async engine with its core in a process of its own.

    event loops ── add/abort (under a lock) ──> CoreClient.send ──ZMQ──> engine-core process
    collectors <── hand_out ── reader thread: recv, detokenize, stop strings <──ZMQ── outputs

This process keeps what needs the tokenizer or talks to clients: input processing (worker
threads), detokenization and stop strings (the reader thread), streaming. The core process only
steps. If it dies, running requests fail with EngineDeadError, new ones get 503 while it is
restarted (at most `max_restarts` times; `restart=False` leaves the engine dead), and `/health`
says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mm_engine.async_frontend import AsyncFrontend
from mm_engine.async_types import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineStepError,
    ModelInfo,
    StatsListener,
)
from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.client import CoreClient
from mm_engine.core.mp_engine import PIXEL_CACHE_BYTES
from mm_engine.core.pixels import PixelLedger
from mm_engine.engine_loop import Command, Stream, hand_out
from mm_engine.frontend import build_frontend
from mm_engine.input_lanes import LIGHT_INPUT_BYTES
from mm_engine.model_loader import load_config, resolve_model_path
from mm_engine.output_processor import OutputProcessor
from mm_engine.vision.image_io import ImageLimits

logger = logging.getLogger("mm_engine.async_llm")


class AsyncMPLLM(AsyncFrontend):
    def __init__(
        self,
        config: EngineConfig,
        *,
        image_limits: ImageLimits | None = None,
        input_workers: int = 2,
        light_input_bytes: int = LIGHT_INPUT_BYTES,
        stall_timeout: float = 60.0,
        listener: StatsListener | None = None,
        restart: bool = True,
        max_restarts: int = 3,
        on_dead: Callable[[], None] | None = None,
    ) -> None:
        """`on_dead`: called (on the reader thread) once the core is down for good."""
        path = resolve_model_path(config.model)
        frontend = build_frontend(config, path, load_config(path))
        if image_limits is not None:
            frontend.inputs.limits = image_limits
        self._core_config = dataclasses.replace(config, model=str(path))
        self._max_image_tokens = frontend.max_image_tokens
        self.eos_token_ids = frontend.eos_token_ids
        self.tokenizer = frontend.tokenizer  # the reader thread's
        self.restart, self.max_restarts, self.restarts = restart, max_restarts, 0
        self.on_dead = on_dead
        self.client = CoreClient(self._core_config, self._max_image_tokens)
        ready = self.client.ready
        self._init_frontend(
            frontend.inputs, ModelInfo(ready.max_model_len, ready.max_num_seqs), ready.max_waiting_requests,
            ready.stats, ready.platform, input_workers, light_input_bytes, stall_timeout, listener,
        )  # fmt: skip
        self._lock = threading.Lock()  # the output processor, the pixel ledger, the send order
        self._output = OutputProcessor(self.tokenizer)
        self._pixels = PixelLedger(PIXEL_CACHE_BYTES)
        self._rpcs: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mm-engine-reader", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs: Any) -> AsyncMPLLM:
        own = {k: kwargs.pop(k) for k in list(kwargs) if k not in EngineConfig.__dataclass_fields__}
        return cls(EngineConfig.from_kwargs(model, **kwargs), **own)

    # ---- event-loop side ---------------------------------------------------------------------

    def _send(self, cmd: Command) -> None:
        stream = self._streams.get(cmd.request_id) if cmd.kind == "add" else cmd.stream
        if cmd.kind == "add":
            inputs, params, priority = cmd.args
            with self._lock:
                if self._dead:
                    self._finish(stream, EngineDeadError("the engine is not running"))
                    return
                images, forget = self._pixels.encode(inputs.spans)
                eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
                arrival = time.time()
                self._output.add(cmd.request_id, inputs.text, inputs.token_ids, params, arrival)
                add = m.Add(cmd.request_id, inputs.token_ids, images, params, eos, priority, arrival, forget)
                self.client.send(add)
            stream.in_engine = True
        elif cmd.kind == "abort":
            with self._lock:
                self._output.abort(cmd.request_id)
                if not self._dead:
                    self.client.send(m.Abort([cmd.request_id]))
            if stream is not None and not stream.finished:
                if stream.in_engine and self.listener is not None:
                    self.listener.on_aborted(stream.modality)
                self._finish(stream, cmd.error)
        elif cmd.kind == "stop":
            self._stopping = True
            with self._lock:
                if self.client.alive:
                    self.client.send(m.Shutdown())

    async def kv_report(self) -> dict[str, dict]:
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._rpcs[call_id] = future
        with self._lock:
            if self._dead:
                raise EngineDeadError("the engine is not running")
            self.client.send(m.Rpc(call_id, "kv_report"))
        return await asyncio.wrap_future(future)

    @staticmethod
    def _finish(stream: Stream | None, error: BaseException | None) -> None:
        if stream is not None and not stream.finished:
            stream.finished = True
            if error is not None:
                stream.put(error)

    # ---- reader thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            msg = self.client.recv(0.25)
            if msg is None:
                if self.client.alive:
                    continue
                msg = m.Dead(f"the engine core process exited (code {self.client.proc.returncode})")
            self._heartbeat = time.monotonic()
            if isinstance(msg, m.Dead):
                if not self._core_died(msg.reason):
                    break
            else:
                self._handle(msg)
        self._dead = True
        with self._lock:
            self.client.close()
        if self.on_dead is not None and not self._stopping:
            self.on_dead()

    def _handle(self, msg: m.FromCore) -> None:
        if isinstance(msg, m.Outputs):
            self._stats = msg.stats
            if msg.step_seconds and self.listener is not None:
                self.listener.on_step(msg.step_seconds, len(msg.outputs), msg.stats)
            with self._lock:
                outputs, stopped = self._output.process(msg.outputs)
                if stopped:  # stop strings ended them: the core must not generate more
                    self.client.send(m.Abort(stopped))
            self._last_step_failed = False if msg.step_seconds else self._last_step_failed
            hand_out(self._streams, outputs, self.listener)
        elif isinstance(msg, m.Reject):
            with self._lock:
                self._output.abort(msg.request_id)
            error = {"invalid": ValueError, "full": EngineOverloadedError}.get(msg.kind)
            self._finish(
                self._streams.get(msg.request_id),
                error(msg.message) if error else EngineError("the engine could not accept the request"),
            )
        elif isinstance(msg, m.StepFailed):
            self._faults += 1
            self._last_step_failed = True
            self._last_error = f"engine step failed ({msg.error_kind})"
            with self._lock:
                for rid in msg.request_ids:
                    self._output.abort(rid)
            for rid in msg.request_ids:
                self._finish(
                    self._streams.get(rid), EngineStepError("the engine failed while running this request")
                )
        elif isinstance(msg, m.RpcReply):
            future = self._rpcs.pop(msg.call_id, None)
            if future is not None:
                future.set_result(msg.result)

    def _core_died(self, reason: str) -> bool:
        """Fail what was running; restart the core if allowed. Returns whether to go on."""
        with self._lock:
            self._dead = True  # new requests get 503 from now on
            self._output = OutputProcessor(self.tokenizer)
            self._pixels = PixelLedger(PIXEL_CACHE_BYTES)  # a new core holds no pixels
        for future in self._rpcs.values():
            future.set_exception(EngineDeadError("the engine core stopped"))
        self._rpcs.clear()
        for stream in list(self._streams.values()):
            self._finish(stream, EngineDeadError("the engine core stopped while running this request"))
        if self._stopping:
            return False
        self._faults += 1
        self._last_error = reason
        logger.error("engine core died: %s", reason)
        if not self.restart or self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        with self._lock:
            self.client.close(timeout=2.0)
        try:
            client = CoreClient(self._core_config, self._max_image_tokens)
        except Exception as exc:
            self._last_error = f"{reason}; restarting it failed ({type(exc).__name__})"
            return False
        logger.warning("engine core restarted (%d of at most %d)", self.restarts, self.max_restarts)
        with self._lock:
            self.client = client
            self._last_error = f"{reason}; restarted ({self.restarts} of {self.max_restarts})"
            self._dead = False
        return True
