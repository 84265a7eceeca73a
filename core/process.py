"""The engine-core process: `python -m mm_engine.core.process`, started by core/client.py.

It reads its start-up settings (engine config, addresses) as JSON on stdin, builds the EngineCore,
says Ready, and then runs a busy loop: take every message waiting (adds, aborts, calls), run one
step when there is work, send that step's outputs in one message. While idle it waits for
messages and sends a heartbeat (stats) every second. A device fault ends the process (exit 3); a
vanished frontend (our parent pid changes: checked every second, and whenever a send finds nobody
reading) ends it quietly.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import msgspec
import zmq

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.engine_core import EngineCore
from mm_engine.core.pixels import PixelStore
from mm_engine.core.types import CoreRequest
from mm_engine.faults import StepFailedError
from mm_engine.sched.scheduler import QueueFullError

HEARTBEAT_S = 1.0
EXIT_DEVICE_LOST = 3


class StartUp(msgspec.Struct):
    config: EngineConfig
    max_image_tokens: int
    in_addr: str  # frontend -> core (we PULL)
    out_addr: str  # core -> frontend (we PUSH)


class FrontendGone(Exception):
    """Our frontend process has exited: there is nobody to send to."""


class CoreProcess:
    def __init__(self, core: EngineCore, pull: zmq.Socket, push: zmq.Socket) -> None:
        self.core, self.pull, self.push = core, pull, push
        self.pixels = PixelStore()
        self.running = True
        self.parent = os.getppid()  # the frontend that started us

    def send(self, msg: msgspec.Struct) -> None:
        data = m.encode(msg)
        while True:
            try:
                self.push.send(data, copy=False)  # times out (SNDTIMEO) when nobody reads
                return
            except zmq.Again:
                if os.getppid() != self.parent:
                    raise FrontendGone from None

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
                while self.running and self.pull.poll(0):  # every message waiting, then a step
                    self.apply(m.decode_to_core(self.pull.recv(copy=False).buffer))
            if not self.running:
                break
            if self.core.has_unfinished():
                code = self.step()
                if code:
                    return code
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                # Busy or not: an orphan would block on a send nobody reads once the queue fills.
                if os.getppid() != parent:  # the frontend is gone: nobody to serve
                    return 0
                if not self.core.has_unfinished():
                    self.send(m.Outputs([], self.core.stats(), 0.0))
                last_beat = time.monotonic()
        return 0

    def step(self) -> int:
        start = time.perf_counter()
        try:
            outputs = self.core.step()
        except StepFailedError as exc:
            kind = type(exc.__cause__ or exc).__name__
            self.send(m.StepFailed(exc.request_ids, exc.device_lost, kind))
            if exc.device_lost:
                self.send(m.Dead(f"device fault ({kind})"))
                return EXIT_DEVICE_LOST
            return 0
        self.send(m.Outputs(outputs, self.core.stats(), time.perf_counter() - start))
        return 0

    def apply(self, msg: m.ToCore) -> None:
        if isinstance(msg, m.Add):
            self.add(msg)
        elif isinstance(msg, m.Abort):
            for rid in msg.request_ids:
                self.core.abort(rid)
        elif isinstance(msg, m.Rpc):
            method = {"kv_report": self.core.kv_report, "stats": self.core.stats}.get(msg.method)
            self.send(m.RpcReply(msg.call_id, method() if method else None))
        elif isinstance(msg, m.Shutdown):
            self.running = False

    def add(self, msg: m.Add) -> None:
        try:
            spans = self.pixels.spans(msg.images, msg.forget)  # first: the store mirrors the ledger
            req = CoreRequest(
                msg.request_id, msg.token_ids, spans, msg.params, frozenset(msg.eos_token_ids),
                msg.priority, msg.arrival_time,
            )  # fmt: skip
            self.core.add(req)
            self.send(m.Accepted(msg.request_id))
        except ValueError as exc:  # the client's request cannot run: its message is for the client
            self.send(m.Reject(msg.request_id, "invalid", str(exc)))
        except QueueFullError as exc:
            self.send(m.Reject(msg.request_id, "full", str(exc)))
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.send(m.Reject(msg.request_id, "error", type(exc).__name__))


def main() -> int:
    start = msgspec.json.decode(sys.stdin.buffer.read(), type=StartUp)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.setsockopt(zmq.SNDTIMEO, 1000)  # a blocked send wakes up to check that the frontend lives
    pull.connect(start.in_addr)
    push.connect(start.out_addr)
    try:
        core = EngineCore(start.config, start.max_image_tokens)
    except Exception as exc:  # a bad config or checkpoint: say why, briefly, and stop
        traceback.print_exc(file=sys.stderr)
        push.send(m.encode(m.Dead(f"the engine core could not start: {type(exc).__name__}: {exc}")))
        return 1
    config = start.config
    ready = m.Ready(core.max_model_len, config.max_num_seqs, config.max_waiting_requests,
                    core.platform.info(), core.stats(), os.getpid())  # fmt: skip
    push.send(m.encode(ready))
    try:
        return CoreProcess(core, pull, push).serve()
    finally:
        core.close()
        pull.close(0)
        push.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
