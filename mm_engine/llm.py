"""The offline Python API, shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from mm_engine.config import EngineConfig
from mm_engine.engine.llm_engine import LLMEngine
from mm_engine.outputs import RequestOutput
from mm_engine.sampling_params import RequestOutputKind, SamplingParams
from mm_engine.sched.scheduler import QueueFullError


class LLM:
    def __init__(self, model: str | None = None, *, multiprocess: bool = False, **engine_args: Any) -> None:
        """`model`: a checkpoint folder or a Hub name; None means the embedded demo model.
        `multiprocess`: run the engine core in a process of its own (tokenizing and
        detokenizing stay here and overlap with its steps)."""
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args), multiprocess=multiprocess)

    def close(self) -> None:
        """Stop the engine-core process, if there is one (it also stops when the LLM is collected)."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        inputs = [functools.partial(self.engine.inputs.process, prompt) for prompt in prompts]
        return self._run(inputs, sampling_params, priority)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        mm_processor_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations, through the chat
        template. `mm_processor_kwargs`: processor options for these requests (e.g. `max_pixels`).
        `tools`: OpenAI function tools the template describes to the model (families with a
        tool-call format only); `mm_engine.frontend.tool_calls` parses the calls out of the text."""
        if not isinstance(messages, list | tuple):
            kind = type(messages).__name__
            raise ValueError(f"messages must be a list of message dicts (or of such lists), got {kind}")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        inputs = [
            functools.partial(self.engine.inputs.chat, conv, mm_processor_kwargs, tools) for conv in convs
        ]
        return self._run(inputs, sampling_params, priority)

    def kv_report(self) -> dict[str, dict[str, int]]:
        """Per pool (`"text"`, `"image"`): total, used and free blocks, allocated and filled slots."""
        return self.engine.kv_report()

    def _run(self, inputs: list, sampling_params, priority) -> list[RequestOutput]:
        """`inputs`: per prompt, what processes it (text, ids, images). A prompt whose params ask for
        `n` samples becomes n requests (processed once), merged into one output of n choices."""
        n = len(inputs)
        params = self._per_request(sampling_params or SamplingParams(), n, "sampling_params")
        # Only the finished outputs are returned: no per-step copies of what is generated so far.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        prios = self._per_request(priority if priority is not None else 0, n, "priority")
        groups: list[list[str]] = []
        finals: dict[str, RequestOutput] = {}

        def step() -> None:
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out

        def add(processed, sp: SamplingParams, rid: str | None, pr: int) -> str:
            while True:
                try:
                    return self.engine.add_processed(*processed, sp, rid, pr)
                except QueueFullError:
                    # Offline, a full waiting queue only means "not yet": run a step to make room.
                    if not self.engine.has_unfinished():
                        raise
                    step()

        try:
            for process, sp, pr in zip(inputs, params, prios, strict=True):
                self.engine.inputs.check_structured_outputs(sp)
                processed = process()
                group: list[str] = []
                groups.append(group)
                for j, child in enumerate(sp.children()):
                    group.append(add(processed, child, None if j == 0 else f"{group[0]}-{j}", pr))
            while len(finals) < sum(len(g) for g in groups):
                step()
        except BaseException:
            for rid in (r for g in groups for r in g):  # a bad prompt, or Ctrl-C: nothing stays queued
                self.engine.abort(rid)
            raise
        return [_merge([finals[rid] for rid in group]) for group in groups]

    @staticmethod
    def _per_request(value: Any, n: int, name: str) -> list:
        kind = SamplingParams if name == "sampling_params" else int
        what = "a SamplingParams" if kind is SamplingParams else "an integer"
        if isinstance(value, kind) and not isinstance(value, bool):
            return [value] * n
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be {what} or a list of them, got {type(value).__name__}")
        value = list(value)
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        for i, v in enumerate(value):
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"{name}[{i}] must be {what}, got {type(v).__name__}")
        return value


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """The n samples of one prompt as one output with n choices (indexed 0 .. n-1)."""
    if len(outs) == 1:
        return outs[0]
    choices = [dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
    return dataclasses.replace(outs[0], outputs=choices)
