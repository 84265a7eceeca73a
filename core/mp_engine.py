"""`LLMEngine`'s interface over an engine-core process, for `LLM(..., multiprocess=True)`.

The frontend half (tokenizer, input processing, detokenization) runs in the caller's thread; the
core runs ahead in its own process, so a step's outputs are detokenized here while the core
computes the next one. An add waits for the core to accept or refuse it, so a bad request raises
right away as it does in-process.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.client import CoreClient
from mm_engine.core.pixels import PixelLedger
from mm_engine.faults import StepFailedError
from mm_engine.frontend import PromptIntake, build_frontend
from mm_engine.model_loader import load_config, resolve_model_path
from mm_engine.output_processor import OutputProcessor
from mm_engine.outputs import RequestOutput
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.scheduler import QueueFullError


class MPEngine(PromptIntake):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model)
        frontend = build_frontend(config, path, load_config(path))
        self.tokenizer, self.inputs = frontend.tokenizer, frontend.inputs
        self.eos_token_ids, self.max_model_len = frontend.eos_token_ids, frontend.max_model_len
        self.client = CoreClient(dataclasses.replace(config, model=str(path)), frontend.max_image_tokens)
        self.output = OutputProcessor(self.tokenizer)
        self.pixels = PixelLedger(config.ipc_pixel_cache_bytes)
        self._seq = itertools.count()
        self._stats: dict = self.client.ready.stats
        self._early: list[m.FromCore] = []  # outputs that came while an add waited for its answer

    def add_processed(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        request_id = self._request_id(request_id)
        images, forget = self.pixels.encode(spans)
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        arrival = time.time()
        self.client.send(m.Add(request_id, ids, images, params, eos, priority, arrival, forget))
        while True:  # the core answers an add before it steps again
            msg = self._recv()
            if isinstance(msg, m.Accepted) and msg.request_id == request_id:
                self.output.add(request_id, text, ids, params, arrival)
                return request_id
            if isinstance(msg, m.Reject) and msg.request_id == request_id:
                if msg.kind == "full":
                    raise QueueFullError(msg.message)
                raise ValueError(msg.message) if msg.kind == "invalid" else RuntimeError(msg.message)
            self._early.append(msg)

    def abort(self, request_id: str) -> None:
        self.output.abort(request_id)
        self.client.send(m.Abort([request_id]))

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step (none for a heartbeat)."""
        msg = self._early.pop(0) if self._early else self._recv()
        if isinstance(msg, m.StepFailed):
            for rid in msg.request_ids:
                self.output.abort(rid)
            raise StepFailedError(msg.request_ids, msg.device_lost)
        if not isinstance(msg, m.Outputs):
            return []
        self._stats = msg.stats
        outputs, stopped = self.output.process(msg.outputs)
        if stopped:  # stop strings ended them: the core must not generate more
            self.client.send(m.Abort(stopped))
        return outputs

    def _recv(self) -> m.FromCore:
        while True:
            msg = self.client.recv(1.0)
            if isinstance(msg, m.Dead):
                raise RuntimeError(f"the engine core stopped: {msg.reason}")
            if msg is not None:
                return msg
            if not self.client.alive:
                raise RuntimeError(f"the engine core process died (exit code {self.client.proc.returncode})")

    def has_unfinished(self) -> bool:
        return len(self.output) > 0

    def stats(self) -> dict:
        return self._stats

    def kv_report(self) -> dict[str, dict]:
        self.client.send(m.Rpc(0, "kv_report"))
        while True:
            msg = self._recv()
            if isinstance(msg, m.RpcReply):
                return msg.result
            self._early.append(msg)

    def close(self) -> None:
        self.client.close()

    def __del__(self) -> None:
        client = self.__dict__.get("client")
        if client is not None and client.alive:
            client.close(timeout=2.0)
