"""The one interface between a frontend and an engine core, wherever the core runs (the shape of
vLLM's `EngineCoreClient`):

    add(CoreRequest)    abort([ids])    outputs() -> one step's CoreOutputs    stats()    close()

`InProcessCore` calls an `EngineCore` in the caller's thread. `ProcessCore` talks to one in a
process of its own over ZMQ (engine/process_client.py): an add does not wait for the core (which
answers only a refusal), so a request the core refuses surfaces from the next `outputs()` as
`RequestRefused`, and one refused for a full waiting queue is sent again once a step has finished.
"""

from __future__ import annotations

from typing import Protocol

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.engine_core import EngineCore
from mm_engine.core.faults import StepFailedError
from mm_engine.core.pixels import PixelLedger, add_message
from mm_engine.core.structured_output import Grammars
from mm_engine.core.types import CoreOutput, CoreRequest
from mm_engine.engine.process_client import CoreProcess


class RequestRefused(Exception):
    """The core refused `request_id`; `error` is what its caller gets (ValueError: the request's
    own fault; RuntimeError: the engine's)."""

    def __init__(self, request_id: str, error: Exception) -> None:
        super().__init__(str(error))
        self.request_id = request_id
        self.error = error


class EngineCoreClient(Protocol):
    def add(self, request: CoreRequest) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def outputs(self) -> list[CoreOutput]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict: ...
    def kv_report(self) -> dict[str, dict]: ...
    def platform_info(self) -> dict: ...
    def close(self) -> None: ...


class InProcessCore:
    """The core in the caller's thread: every call is a call (an add that cannot run raises
    ValueError, or QueueFullError, at once)."""

    def __init__(self, config: EngineConfig, max_image_tokens: int, grammars: Grammars | None = None) -> None:
        self.core = EngineCore(config, max_image_tokens, grammars)

    def add(self, request: CoreRequest) -> None:
        self.core.add(request)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.core.abort(rid)

    def outputs(self) -> list[CoreOutput]:
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def stats(self) -> dict:
        return self.core.stats()

    def kv_report(self) -> dict[str, dict]:
        return self.core.kv_report()

    def platform_info(self) -> dict:
        return self.core.platform.info()

    def close(self) -> None:
        self.core.close()


class ProcessCore:
    """The core in a process of its own; this side keeps which pixels it holds."""

    def __init__(self, config: EngineConfig, max_image_tokens: int) -> None:
        self.process = CoreProcess(config, max_image_tokens)
        self.pixels = PixelLedger(config.ipc_pixel_cache_bytes)
        self._stats: dict = self.process.ready.stats
        self._early: list[m.FromCore] = []  # messages that came while waiting for an RPC's answer
        # Each live request's Add (added, not finished or aborted): sent again if the core refused
        # it for a full queue.
        self._live: dict[str, m.Add] = {}
        self._backlog: list[str] = []  # refused for a full queue: sent again after the next step

    def add(self, request: CoreRequest) -> None:
        add = add_message(request, self.pixels.plan(request.images))
        self.process.send(add)  # not waiting for the answer: the core answers between its steps
        self._live[request.request_id] = add

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._live.pop(rid, None)
        self.process.send(m.Abort(list(request_ids)))

    def outputs(self) -> list[CoreOutput]:
        """The core's next step (none for a heartbeat or an answer to an add)."""
        msg = self._early.pop(0) if self._early else self._recv()
        if isinstance(msg, m.Reject):
            if msg.request_id not in self._live:  # aborted meanwhile: nobody to tell
                return []
            if msg.kind == "full":
                self._backlog.append(msg.request_id)
                return []
            del self._live[msg.request_id]
            error = ValueError(msg.message) if msg.kind == "invalid" else RuntimeError(msg.message)
            raise RequestRefused(msg.request_id, error)
        if isinstance(msg, m.StepFailed):
            for rid in msg.request_ids:
                self._live.pop(rid, None)
            raise StepFailedError(msg.request_ids, msg.device_lost)
        if not isinstance(msg, m.Outputs):
            return []
        self._stats = msg.stats
        for out in msg.outputs:
            if out.finish_reason is not None:
                self._live.pop(out.request_id, None)
        if self._backlog:  # a step ran (or the core idles): its queue may have room again
            for rid in self._backlog:
                if rid in self._live:  # else aborted meanwhile
                    self.process.send(self._live[rid])
            self._backlog.clear()
        return msg.outputs

    def _recv(self) -> m.FromCore:
        while True:
            msg = self.process.recv(1.0)
            if isinstance(msg, m.Dead):
                raise RuntimeError(f"the engine core stopped: {msg.reason}")
            if msg is not None:
                return msg
            if not self.process.alive:
                raise RuntimeError(f"the engine core process died (exit code {self.process.proc.returncode})")

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def stats(self) -> dict:
        return self._stats

    def kv_report(self) -> dict[str, dict]:
        self.process.send(m.Rpc(0, "kv_report"))
        while True:
            msg = self._recv()
            if isinstance(msg, m.RpcReply):
                return msg.result
            self._early.append(msg)

    def platform_info(self) -> dict:
        return self.process.ready.platform

    def close(self) -> None:
        self.process.close()

    def __del__(self) -> None:
        process = self.__dict__.get("process")
        if process is not None and process.alive:
            process.close(timeout=2.0)
