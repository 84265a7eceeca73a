"""What the frontend builds from a checkpoint: the tokenizer, the input processor (chat template,
the family's image processing) and the limits that depend on them. In-process (`LLMEngine`) and
in front of an engine-core process alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, GenerationConfig

import mm_engine.models as models
from mm_engine.config import EngineConfig
from mm_engine.core.structured_output import Grammars
from mm_engine.frontend.inputs import InputProcessor, find_chat_template
from mm_engine.frontend.output_processor import OutputProcessor
from mm_engine.frontend.thread_tokenizer import PerThreadTokenizer
from mm_engine.frontend.tool_calls import tool_format_for
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams

IMAGE_TOKEN_FRACTION = 0.25  # of max_model_len: the default max_image_tokens


@dataclass(slots=True)
class Frontend:
    tokenizer: object  # for the thread that detokenizes; the input processor has per-thread copies
    inputs: InputProcessor
    eos_token_ids: frozenset[int]
    max_model_len: int
    max_image_tokens: int


class PromptIntake:
    """`add_request` and `add_chat_request` for an engine: inputs processed here, then handed to
    the engine's own `add_processed` (in-process core, or a core process)."""

    inputs: InputProcessor
    output: OutputProcessor  # whose requests are live
    _seq: Iterator[int]

    def _request_id(self, request_id: str | None) -> str:
        """The caller's id (refused when live already), else the next number."""
        request_id = str(next(self._seq)) if request_id is None else str(request_id)
        if request_id in self.output:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def add_processed(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        raise NotImplementedError

    def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> str:
        self.inputs.check_structured_outputs(params)
        text, ids, spans = self.inputs.process(prompt)
        return self.add_processed(text, ids, spans, params, request_id, priority)

    def add_chat_request(
        self, messages: list[dict], params: SamplingParams, request_id: str | None = None, priority: int = 0,
        mm_processor_kwargs: dict | None = None, tools: list[dict] | None = None,
    ) -> str:  # fmt: skip
        self.inputs.check_structured_outputs(params)
        text, ids, spans = self.inputs.chat(messages, mm_processor_kwargs, tools)
        return self.add_processed(text, ids, spans, params, request_id, priority)


def build_frontend(config: EngineConfig, path: Path, hf_config) -> Frontend:
    tokenizer = AutoTokenizer.from_pretrained(path)
    per_thread = PerThreadTokenizer(tokenizer)
    processing = models.make_processing(path, per_thread, hf_config, config.mm_processor_kwargs)
    inputs = InputProcessor(per_thread, processing, find_chat_template(path, tokenizer))
    max_model_len = config.max_model_len or hf_config.text_config.max_position_embeddings
    # No token is longer than the vocabulary's longest string: text beyond max_model_len of
    # those (twice over, for normalisers that fold characters) cannot fit.
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    inputs.max_prompt_chars = 2 * max_model_len * max(longest, 1)
    inputs.grammars = Grammars(per_thread.get, hf_config.text_config.vocab_size)
    inputs.tool_format = tool_format_for(hf_config.model_type, inputs.chat_template)
    if config.max_image_tokens:
        max_image_tokens = config.max_image_tokens
    elif processing.fixed_tokens is not None:  # LLaVA-1.5: every image the same, no cap needed
        max_image_tokens = max(processing.fixed_tokens, max_model_len)
    else:  # the image's size decides: one huge upload must not take thousands of tokens unasked
        max_image_tokens = max(1, int(max_model_len * IMAGE_TOKEN_FRACTION))
    return Frontend(tokenizer, inputs, _eos_ids(path, tokenizer), max_model_len, max_image_tokens)


def _eos_ids(path: Path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    except OSError:  # no generation_config.json
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
