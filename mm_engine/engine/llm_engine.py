"""The in-process engine: a frontend (tokenizer, input processing, detokenization) around the
engine core (model, pools, scheduler), in the caller's thread.

    add_request: inputs.process -> core.add          step: core.step -> output.process -> outputs

`LLM` runs on this; `AsyncLLM` runs it on an engine thread. The core's parts (scheduler, blocks,
runner, requests, ...) are reachable as attributes of the engine, for callers that inspect them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from mm_engine.config import EngineConfig
from mm_engine.core.engine_core import EngineCore
from mm_engine.core.faults import StepFailedError
from mm_engine.core.types import CoreRequest
from mm_engine.frontend.output_processor import OutputProcessor
from mm_engine.frontend.setup import PromptIntake, build_frontend
from mm_engine.models.loader import load_config, resolve_model_path
from mm_engine.outputs import RequestOutput
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams


class LLMEngine(PromptIntake):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model)
        frontend = build_frontend(config, path, load_config(path))
        self.tokenizer = frontend.tokenizer  # the detokenizer's (this thread's); inputs have copies
        self.inputs = frontend.inputs
        self.eos_token_ids = frontend.eos_token_ids
        self.max_model_len = frontend.max_model_len
        self.core = EngineCore(dataclasses.replace(config, model=str(path)), frontend.max_image_tokens)
        self.output = OutputProcessor(self.tokenizer)
        self._seq = itertools.count()

    def __getattr__(self, name: str) -> Any:
        # Only called for names the engine itself lacks: the core's scheduler, blocks, runner, ...
        if name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    # ---- requests in -------------------------------------------------------------------------

    def add_processed(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        """Queue a request whose inputs `self.inputs` already processed (possibly on another thread)."""
        request_id = self._request_id(request_id)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        arrival = time.time()
        self.core.add(CoreRequest(request_id, ids, spans, params, eos, priority, arrival))
        self.output.add(request_id, text, ids, params, arrival)
        return request_id

    def check_fits(self, ids: list[int], spans: list[ImageSpan], params: SamplingParams) -> None:
        """Refuse a request that could never run, before it takes anything."""
        self.core.check_fits(CoreRequest("probe", ids, spans, params, frozenset()))

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.output.abort(request_id)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return an output for each request that advanced (as
        its `output_kind` asks).

        Raises StepFailedError when the pass fails: the requests it held are dropped (their
        blocks freed), every other request stays as it was."""
        try:
            core_outputs = self.core.step()
        except StepFailedError as exc:
            for rid in exc.request_ids:
                self.output.abort(rid)
            raise
        outputs, stopped = self.output.process(core_outputs)
        for rid in stopped:  # a stop string ended it: the core must not generate more
            self.core.abort(rid)
        return outputs

    # ---- state -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def kv_report(self) -> dict[str, dict]:
        return self.core.kv_report()

    def stats(self) -> dict:
        return self.core.stats()
