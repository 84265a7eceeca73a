"""`LLMEngine`'s interface over an engine-core process, for `LLM(..., multiprocess=True)`.

The frontend half (tokenizer, input processing, detokenization) runs in the caller's thread; the
core runs ahead in its own process, so a step's outputs are detokenized here while the core
computes the next one. Adds do not wait for the core's answer (it answers between its steps): a
request it refuses raises from the next `step()`, and one refused because its waiting queue is
full is kept here and sent again after a step.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.faults import StepFailedError
from mm_engine.core.pixels import PixelLedger
from mm_engine.engine.process_client import CoreClient
from mm_engine.frontend.output_processor import OutputProcessor
from mm_engine.frontend.setup import PromptIntake, build_frontend
from mm_engine.models.loader import load_config, resolve_model_path
from mm_engine.outputs import RequestOutput
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams


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
        self._early: list[m.FromCore] = []  # outputs that came while waiting for an RPC's answer
        self._sent: dict[str, m.Add] = {}  # adds the core has not answered yet
        self._backlog: list[m.Add] = []  # adds refused for a full queue, to send again

    def add_processed(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        request_id = self._request_id(request_id)
        images, forget = self.pixels.encode(spans)
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        arrival = time.time()
        add = m.Add(request_id, ids, images, params, eos, priority, arrival, forget)
        self.client.send(add)  # not waiting for the answer: the core answers between its steps
        self._sent[request_id] = add
        self.output.add(request_id, text, ids, params, arrival)
        return request_id

    def abort(self, request_id: str) -> None:
        self.output.abort(request_id)
        self.client.send(m.Abort([request_id]))

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step (none for a heartbeat). A request the core refused
        raises here (ValueError for the caller's mistake); one refused for a full queue is sent
        again once a step has finished."""
        msg = self._early.pop(0) if self._early else self._recv()
        if isinstance(msg, m.Accepted):
            self._sent.pop(msg.request_id, None)
            return []
        if isinstance(msg, m.Reject):
            add = self._sent.pop(msg.request_id, None)
            if msg.request_id not in self.output:  # aborted meanwhile: nobody to tell
                return []
            if msg.kind == "full" and add is not None:
                self._backlog.append(add)
                return []
            self.output.abort(msg.request_id)
            raise ValueError(msg.message) if msg.kind == "invalid" else RuntimeError(msg.message)
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
        if self._backlog:  # a step ran (or the core idles): its queue may have room again
            for add in self._backlog:
                if add.request_id in self.output:
                    self._sent[add.request_id] = add
                    self.client.send(add)
            self._backlog.clear()
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
