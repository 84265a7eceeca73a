"""The synchronous engine: a `Frontend` in the caller's thread and an engine core behind an
`EngineCoreClient`, in this process or in one of its own.

    add_processed: frontend.request -> client.add        step: client.outputs -> frontend -> outputs

`LLM` runs on this; `AsyncLLM` runs it on an engine thread.
"""

from __future__ import annotations

import dataclasses

from mm_engine.config import EngineConfig
from mm_engine.core.engine_core import EngineCore
from mm_engine.core.faults import StepFailedError
from mm_engine.engine.core_client import EngineCoreClient, InProcessCore, ProcessCore, RequestRefused
from mm_engine.frontend.frontend import Frontend
from mm_engine.models.loader import load_config, resolve_model_path
from mm_engine.outputs import RequestOutput
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams
from mm_engine.vision.image_io import ImageLimits
from mm_engine.vision.video_io import VideoLimits


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        multiprocess: bool = False,
        image_limits: ImageLimits | None = None,
        video_limits: VideoLimits | None = None,
    ) -> None:
        """`multiprocess`: the core in a process of its own (this thread detokenizes one step's
        outputs while the core computes the next). `image_limits`: what every image is checked
        against."""
        self.config = config
        path = resolve_model_path(config.model)
        self.frontend = Frontend(config, path, load_config(path), image_limits, video_limits)
        core_config = dataclasses.replace(config, model=str(path))
        max_image_tokens = self.frontend.max_image_tokens
        self.client: EngineCoreClient = (
            ProcessCore(core_config, max_image_tokens)
            if multiprocess
            else InProcessCore(core_config, max_image_tokens, self.frontend.inputs.grammars)
        )
        self.inputs = self.frontend.inputs
        self.tokenizer = self.frontend.tokenizer
        self.max_model_len = self.frontend.max_model_len

    @property
    def core(self) -> EngineCore:
        """The engine core itself, where it runs in this process (for tests and tools that look
        inside it: its scheduler, pools, runner)."""
        if not isinstance(self.client, InProcessCore):
            raise AttributeError("the engine core runs in a process of its own")
        return self.client.core

    # ---- requests in -------------------------------------------------------------------------

    def add_request(
        self, prompt, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> str:
        """A `generate`-style prompt (a string, or a dict with images), processed in this thread."""
        self.inputs.check_structured_outputs(params)
        return self.add_processed(*self.inputs.process(prompt), params, request_id, priority)

    def add_processed(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        """Queue a request whose inputs `self.inputs` already processed (possibly on another thread)."""
        request = self.frontend.request(text, ids, spans, params, request_id, priority)
        try:
            self.client.add(request)
        except BaseException:
            self.frontend.abort(request.request_id)
            raise
        return request.request_id

    def abort(self, request_id: str) -> None:
        self.client.abort([request_id])
        self.frontend.abort(request_id)

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return an output for each request that advanced (as
        its `output_kind` asks).

        Raises StepFailedError when the pass fails: the requests it held are dropped (their
        blocks freed), every other request stays as it was. A request the core refused raises
        its error here (a core process answers adds between its steps)."""
        try:
            core_outputs = self.client.outputs()
        except StepFailedError as exc:
            for rid in exc.request_ids:
                self.frontend.abort(rid)
            raise
        except RequestRefused as refused:
            self.frontend.abort(refused.request_id)
            raise refused.error from None
        outputs, stopped = self.frontend.process_outputs(core_outputs)
        if stopped:  # a stop string ended them: the core must not generate more
            self.client.abort(stopped)
        return outputs

    # ---- state -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.client.has_unfinished()

    def kv_report(self) -> dict[str, dict]:
        return self.client.kv_report()

    def stats(self) -> dict:
        return self.client.stats()

    def platform_info(self) -> dict:
        return self.client.platform_info()

    def close(self) -> None:
        self.client.close()
