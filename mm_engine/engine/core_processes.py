"""The driver of engine cores in processes of their own, one or several (data parallelism).

    event loops ── route, add/abort (under a lock) ──> outbox thread: build, encode, send ──ZMQ──> core
    streams <── hand_out ── a reader thread per core: recv, detokenize, stop strings <──ZMQ──

This process keeps what needs the tokenizer or talks to clients: input processing (worker
threads, the async engine's), detokenization and stop strings (the reader threads, taking turns
with the frontend's output processor under `_lock`), streaming. What is sent is decided under
`_lock` (routing, which pixels the core lacks) and built and sent by one outbox thread, in order
(engine/outbox.py): no pixels are copied on an event loop or under the lock. A core process only
steps. With
several cores each has the whole model and its own pools (routing: engine/cores.py). If a core
dies, its running requests fail with EngineDeadError, the others go on serving, and it is
restarted (at most `max_restarts` times; `restart=False` leaves it down); while no core is up, new
requests get 503. `/health` says why.

With `attach` (one of several API servers, api/supervisor.py) the cores are someone else's: this
side talks to each over a socket pair of its own, tags what it sends with `frontend_index`, never
stops them, and after a core dies waits for the supervisor's new one to say Ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable

from mm_engine.core import messages as m
from mm_engine.core.pixels import PixelLedger, add_message
from mm_engine.engine.async_types import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineStepError,
)
from mm_engine.engine.cores import CoreHandle, route
from mm_engine.engine.outbox import Outbox
from mm_engine.engine.process_client import AttachedCore, CoreProcess
from mm_engine.engine.stats import sum_stats
from mm_engine.engine.streams import Command, Shared, Stream, hand_out
from mm_engine.frontend.frontend import Frontend

logger = logging.getLogger("mm_engine.async_llm")


class CoreProcesses:
    def __init__(
        self,
        clients: list[CoreProcess | AttachedCore],
        frontend: Frontend,
        shared: Shared,
        *,
        pixel_bytes: int,
        affinity_slack: int,
        restart: bool,
        max_restarts: int,
        on_dead: Callable[[], None] | None,
        attached: bool,
        frontend_index: int,
    ) -> None:
        """`on_dead`: called (on a reader thread) once every core is down for good.
        `affinity_slack`: how much busier than the least loaded core an image's core may be and
        still get it."""
        self.frontend = frontend
        self.shared = shared
        self.affinity_slack = affinity_slack
        self.restart, self.max_restarts, self.on_dead = restart, max_restarts, on_dead
        self._attached, self.frontend_index = attached, frontend_index
        self._pixel_bytes = pixel_bytes
        self._cores = [
            CoreHandle(i, c, PixelLedger(pixel_bytes), stats=c.ready.stats) for i, c in enumerate(clients)
        ]
        self._lock = threading.Lock()  # the output processor, the ledgers, the routing, the outbox's order
        self._outbox = Outbox(self._deliver)
        self._where: dict[str, CoreHandle] = {}  # request id -> its core
        self._rpcs: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        for core in self._cores:
            core.thread = threading.Thread(
                target=self._run, args=(core,), name=f"mm-core-{core.index}", daemon=True
            )
            core.thread.start()

    # ---- event-loop side ---------------------------------------------------------------------

    def send(self, cmd: Command) -> None:
        stream = self.shared.streams.get(cmd.request_id) if cmd.kind == "add" else cmd.stream
        if cmd.kind == "add":
            inputs, params, priority = cmd.args
            with self._lock:
                core = route(self._cores, inputs.spans, self.affinity_slack)
                if core is None:
                    self._finish(stream, EngineDeadError("the engine is not running"))
                    return
                request = self.frontend.request(
                    inputs.text, inputs.token_ids, inputs.spans, params, cmd.request_id, priority
                )
                core.requests.add(cmd.request_id)
                self._where[cmd.request_id] = core
                plan, index = core.pixels.plan(request.images), self.frontend_index
                self._post(core, lambda: add_message(request, plan, index))
            stream.in_engine = True
        elif cmd.kind == "abort":
            with self._lock:
                self.frontend.abort(cmd.request_id)
                core = self._where.pop(cmd.request_id, None)
                if core is not None:
                    core.requests.discard(cmd.request_id)
                    self._post(core, m.Abort([cmd.request_id]))
            if stream is not None and not stream.finished:
                listener = self.shared.listener
                if stream.in_engine and listener is not None:
                    listener.on_aborted(stream.modality)
                self._finish(stream, cmd.error)
        elif cmd.kind == "stop":
            with self._lock:
                self._stopping = True
                for core in self._cores:
                    if core.client.alive and not self._attached:  # attached cores are not ours to stop
                        self._post(core, m.Shutdown())

    async def kv_report(self) -> dict[str, dict]:
        """The first live core's report (each core has its own pools); `kv_reports` for all."""
        return (await self.kv_reports())[0]

    async def kv_reports(self) -> list[dict[str, dict]]:
        futures = []
        with self._lock:
            for core in self._cores:
                if core.down:
                    continue
                call_id = next(self._call_ids)
                futures.append(self._rpcs.setdefault(call_id, concurrent.futures.Future()))
                self._post(core, m.Rpc(call_id, "kv_report", self.frontend_index))
        if not futures:
            raise EngineDeadError("the engine is not running")
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def core_of(self, request_id: str) -> int | None:
        """Which core a live request runs on."""
        core = self._where.get(request_id)
        return None if core is None else core.index

    def alive(self) -> bool:
        return any(c.thread is not None and c.thread.is_alive() for c in self._cores)

    def join(self) -> None:
        for core in self._cores:
            if core.thread is not None:
                core.thread.join()
        self._outbox.close()

    def _post(self, core: CoreHandle, msg: m.ToCore | Callable[[], m.ToCore]) -> None:
        """Queue a message for `core` (call under `_lock`, which fixes the order); `msg` may be a
        function that builds it on the outbox thread."""
        if not core.down:
            self._outbox.put((core, core.restarts, msg))

    def _deliver(self, item: tuple) -> None:
        """On the outbox thread: build and send, unless the core died (or was replaced) since."""
        core, restarts, msg = item
        with self._lock:
            if core.down or core.restarts != restarts:
                return
            client = core.client
        client.send(msg() if callable(msg) else msg)

    @staticmethod
    def _finish(stream: Stream | None, error: BaseException | None) -> None:
        if stream is not None:  # None: its consumer is gone already
            stream.finish(error)

    # ---- reader threads ----------------------------------------------------------------------

    def _run(self, core: CoreHandle) -> None:
        while True:
            msg = core.client.recv(0.25)
            if msg is None:
                if core.client.alive and not (self._stopping and self._attached):
                    continue
                msg = m.Dead(core.client.exit_message())
            self.shared.vitals.heartbeat = time.monotonic()
            if isinstance(msg, m.Dead):
                if not self._core_died(core, msg.reason):
                    break
            else:
                self._handle(core, msg)
        with self._lock:
            core.client.close()
            core.gone = True
            everyone_gone = all(c.gone for c in self._cores)
        if everyone_gone and self.on_dead is not None and not self._stopping:
            self.on_dead()

    def _handle(self, core: CoreHandle, msg: m.FromCore) -> None:
        vitals, listener = self.shared.vitals, self.shared.listener
        if isinstance(msg, m.Outputs):
            core.stats = msg.stats
            vitals.stats = sum_stats([c.stats for c in self._cores])
            if msg.step_seconds and listener is not None:
                listener.on_step(msg.step_seconds, len(msg.outputs), msg.stats)
            with self._lock:
                outputs, stopped = self.frontend.process_outputs(msg.outputs)
                if stopped:  # stop strings ended them: the core must not generate more
                    self._post(core, m.Abort(stopped))
                for out in outputs:
                    if out.finished:
                        self._forget(out.request_id)
            if msg.step_seconds:
                vitals.last_step_failed = False
            hand_out(self.shared.streams, outputs, listener)
        elif isinstance(msg, m.Reject):
            with self._lock:
                self.frontend.abort(msg.request_id)
                self._forget(msg.request_id)
            error = {"invalid": ValueError, "full": EngineOverloadedError}.get(msg.kind)
            self._finish(
                self.shared.streams.get(msg.request_id),
                error(msg.message) if error else EngineError("the engine could not accept the request"),
            )
        elif isinstance(msg, m.StepFailed):
            vitals.faults += 1
            vitals.last_step_failed = True
            vitals.last_error = self._which(core) + f"engine step failed ({msg.error_kind})"
            with self._lock:
                for rid in msg.request_ids:
                    self.frontend.abort(rid)
                    self._forget(rid)
            error = EngineStepError("the engine failed while running this request")
            for rid in msg.request_ids:
                self._finish(self.shared.streams.get(rid), error)
        elif isinstance(msg, m.RpcReply):
            future = self._rpcs.pop(msg.call_id, None)
            if future is not None:
                future.set_result(msg.result)

    def _forget(self, request_id: str) -> None:
        core = self._where.pop(request_id, None)
        if core is not None:
            core.requests.discard(request_id)

    def _which(self, core: CoreHandle) -> str:
        return f"core {core.index}: " if len(self._cores) > 1 else ""

    def _core_died(self, core: CoreHandle, reason: str) -> bool:
        """Fail what ran on `core`; restart it if allowed. Returns whether to go on reading."""
        with self._lock:
            core.down = True
            self.shared.vitals.dead = all(c.down for c in self._cores)  # 503 once no core is up
            core.pixels = PixelLedger(self._pixel_bytes)  # a new core holds no pixels
            lost = list(core.requests)
            for rid in lost:
                self.frontend.abort(rid)
                self._forget(rid)
        for future in list(self._rpcs.values()):
            if not future.done():
                future.set_exception(EngineDeadError("the engine core stopped"))
        self._rpcs.clear()
        for rid in lost:
            self._finish(
                self.shared.streams.get(rid),
                EngineDeadError("the engine core stopped while running this request"),
            )
        if self._stopping:
            return False
        vitals = self.shared.vitals
        vitals.faults += 1
        vitals.last_error = self._which(core) + reason
        logger.error("engine core %d died: %s", core.index, reason)
        # An attached core is its supervisor's to restart (or to give up on: then it stops us).
        if not self._attached and (not self.restart or core.restarts >= self.max_restarts):
            return False
        core.restarts += 1
        with self._lock:
            old = core.client
            if not self._attached:  # an attached link stays: the new core connects to it
                old.close(timeout=2.0)
        try:
            client = old.restarted()
        except Exception as exc:
            vitals.last_error = self._which(core) + f"{reason}; restarting it failed ({type(exc).__name__})"
            return False
        logger.warning(
            "engine core %d restarted (%d of at most %d)", core.index, core.restarts, self.max_restarts
        )
        with self._lock:
            if self._stopping:  # shut down while it restarted: it must not outlive us
                client.close()
                return False
            core.client = client
            vitals.last_error = (
                self._which(core) + f"{reason}; restarted ({core.restarts} of {self.max_restarts})"
            )
            core.down = False
            vitals.dead = False
        return True

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self._cores)

    @property
    def client(self) -> CoreProcess:
        """The first core's client (the only one unless data-parallel)."""
        return self._cores[0].client
