"""The engine-core process: `python -m mm_engine.core.process`, started by mm_engine/engine/process_client.py.

It reads its start-up settings (engine config, addresses) as JSON on stdin, builds the EngineCore,
says Ready, and then runs a busy loop: take every message waiting (adds, aborts, calls), run one
step when there is work, send that step's outputs in one message. While idle it waits for
messages and sends a heartbeat (stats) every second. A device fault ends the process (exit 3); a
vanished parent (the frontend, or the supervisor of several: our parent pid changes, checked every
second and whenever a send finds nobody reading) ends it quietly.

With several frontends (API servers) there is one socket pair per frontend: messages from all of
them arrive on one PULL socket, a request's outputs go back to the frontend that added it, stats
reach every frontend at least once a second, and each frontend's pixels are kept apart.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import msgspec
import torch
import zmq

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.engine_core import EngineCore
from mm_engine.core.faults import StepFailedError
from mm_engine.core.pixels import PixelStore
from mm_engine.core.types import CoreRequest
from mm_engine.sched.scheduler import QueueFullError

HEARTBEAT_S = 1.0
EXIT_DEVICE_LOST = 3


class StartUp(msgspec.Struct):
    config: EngineConfig
    max_image_tokens: int
    in_addrs: list[str]  # frontend j -> core (we PULL from all)
    out_addrs: list[str]  # core -> frontend j (a PUSH each)


class FrontendGone(Exception):
    """Our frontend process has exited: there is nobody to send to."""


class CoreProcess:
    def __init__(self, core: EngineCore, pull: zmq.Socket, pushes: list[zmq.Socket]) -> None:
        self.core, self.pull, self.pushes = core, pull, pushes
        # A step of background work alone gives way when a message waits (core/background_yield.py).
        core.arrivals = lambda: bool(self.pull.poll(0))
        core.yield_to = self._beside
        self.exit_code = 0  # set where a step beside a paused one lost the device
        self.pixels = [PixelStore() for _ in pushes]  # per frontend: each has its own ledger
        self.owner: dict[str, int] = {}  # request id -> the frontend that added it
        self.last_sent = [0.0] * len(pushes)
        self.running = True
        self.parent = os.getppid()  # the frontend (or the supervisor) that started us

    def send(self, msg: msgspec.Struct, frontend: int = 0) -> None:
        data = m.encode(msg)
        while True:
            try:
                self.pushes[frontend].send(data, copy=False)  # times out (SNDTIMEO) when nobody reads
                self.last_sent[frontend] = time.monotonic()
                return
            except zmq.Again:
                if os.getppid() != self.parent:
                    raise FrontendGone from None

    def broadcast(self, msg: msgspec.Struct) -> None:
        for j in range(len(self.pushes)):
            self.send(msg, j)

    def serve(self) -> int:
        try:
            return self._serve()
        except FrontendGone:  # nobody to serve
            return 0

    def _serve(self) -> int:
        parent, last_beat = self.parent, 0.0
        while self.running:
            busy = self.core.has_unfinished()
            if self.pull.poll(0 if busy else int(HEARTBEAT_S * 1000)):
                self._take_messages()  # every message waiting, then a step
            if not self.running:
                break
            if self.core.has_unfinished():
                code = self.step() or self.exit_code
                if code:
                    return code
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_S:
                # Busy or not: an orphan would block on a send nobody reads once the queue fills.
                if os.getppid() != parent:  # the frontend is gone: nobody to serve
                    return 0
                beat = None
                for j, last in enumerate(self.last_sent):  # whoever heard nothing for a second
                    if now - last >= HEARTBEAT_S:
                        beat = beat or m.Outputs([], self.core.stats(), 0.0)
                        self.send(beat, j)
                last_beat = now
        return 0

    def _take_messages(self) -> None:
        while self.running and self.pull.poll(0):
            self.apply(m.decode_to_core(self.pull.recv(copy=False).buffer))

    def _beside(self) -> None:
        """Called at a layer of a paused step of background work: take in what arrived and run
        foreground steps beside it until none is left (then it goes on)."""
        while self.running and not self.exit_code:
            self._take_messages()
            if not self.running:
                return
            code = self.step(beside=True)
            if code is None:
                return
            self.exit_code = code

    def step(self, beside: bool = False) -> int | None:
        """One step and its outputs sent; an exit code (0: go on). `beside`: a step beside a
        paused one, None when there is none to run."""
        start = time.perf_counter()
        try:
            outputs = self.core.step_beside() if beside else self.core.step()
            if outputs is None:
                return None
        except StepFailedError as exc:
            kind = type(exc.__cause__ or exc).__name__
            for j, ids in self._by_frontend(exc.request_ids, lambda rid: rid).items():
                self.send(m.StepFailed(ids, exc.device_lost, kind), j)
            for rid in exc.request_ids:
                self.owner.pop(rid, None)
            if exc.device_lost:
                self.broadcast(m.Dead(f"device fault ({kind})"))
                return EXIT_DEVICE_LOST
            return 0
        seconds, stats = time.perf_counter() - start, self.core.stats()
        groups = self._by_frontend(outputs, lambda out: out.request_id)
        for out in outputs:
            if out.finish_reason is not None:
                self.owner.pop(out.request_id, None)
        # Frontend 0 times every step (its step histogram is the server's); the others get theirs.
        groups.setdefault(0, [])
        for j, outs in groups.items():
            self.send(m.Outputs(outs, stats, seconds if j == 0 else 0.0), j)
        return 0

    def _by_frontend(self, items: list, request_id) -> dict[int, list]:
        groups: dict[int, list] = {}
        for item in items:
            groups.setdefault(self.owner.get(request_id(item), 0), []).append(item)
        return groups

    def apply(self, msg: m.ToCore) -> None:
        if isinstance(msg, m.Add):
            self.add(msg)
        elif isinstance(msg, m.Abort):
            for rid in msg.request_ids:
                self.core.abort(rid)
                self.owner.pop(rid, None)
        elif isinstance(msg, m.Rpc):
            method = {"kv_report": self.core.kv_report, "stats": self.core.stats}.get(msg.method)
            self.send(m.RpcReply(msg.call_id, method() if method else None), msg.frontend)
        elif isinstance(msg, m.Shutdown):
            self.running = False

    def add(self, msg: m.Add) -> None:
        j = msg.frontend
        if not 0 <= j < len(self.pushes):
            return  # not one of ours: there is nowhere to answer
        try:
            spans = self.pixels[j].spans(msg.images, msg.forget)  # first: the store mirrors the ledger
            req = CoreRequest(
                msg.request_id, msg.token_ids, spans, msg.params, frozenset(msg.eos_token_ids),
                msg.priority, msg.arrival_time,
            )  # fmt: skip
            self.core.add(req)
            self.owner[msg.request_id] = j
        except ValueError as exc:  # the client's request cannot run: its message is for the client
            self.send(m.Reject(msg.request_id, "invalid", str(exc)), j)
        except QueueFullError as exc:
            self.send(m.Reject(msg.request_id, "full", str(exc)), j)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.send(m.Reject(msg.request_id, "error", type(exc).__name__), j)


def main() -> int:
    start = msgspec.json.decode(sys.stdin.buffer.read(), type=StartUp)
    if start.config.cpu_threads is not None:  # a process of our own: its threads are ours to set
        torch.set_num_threads(start.config.cpu_threads)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    for addr in start.in_addrs:
        pull.connect(addr)
    pushes = []
    for addr in start.out_addrs:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.setsockopt(zmq.SNDTIMEO, 1000)  # a blocked send wakes up to check that the parent lives
        push.connect(addr)  # queues what we send until the frontend is there
        pushes.append(push)
    try:
        core = EngineCore(start.config, start.max_image_tokens)
    except Exception as exc:  # a bad config or checkpoint: say why, briefly, and stop
        traceback.print_exc(file=sys.stderr)
        dead = m.encode(m.Dead(f"the engine core could not start: {type(exc).__name__}: {exc}"))
        for push in pushes:
            push.send(dead)
        return 1
    config = start.config
    ready = m.Ready(core.max_model_len, config.max_num_seqs, config.max_waiting_requests,
                    core.platform.info(), core.stats(), os.getpid())  # fmt: skip
    for push in pushes:
        push.send(m.encode(ready))
    try:
        return CoreProcess(core, pull, pushes).serve()
    finally:
        core.close()
        pull.close(0)
        for push in pushes:
            push.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
