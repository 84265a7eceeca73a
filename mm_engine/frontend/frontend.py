"""The frontend: everything on the caller's side of an engine core, built once from the checkpoint.

    prompt or chat --inputs--> text, token ids, image spans --request()--> CoreRequest --> a core
    a core's CoreOutputs --process_outputs()--> RequestOutputs (text, stop strings), stopped ids

It holds the tokenizer, the input processor (chat template, the family's image processing, the
limits that depend on them), the output processor (detokenizer, stop strings), the request ids in
use and the EOS ids. The same object serves an in-process core and cores in other processes.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

import mm_engine.models as models
from mm_engine.config import EngineConfig
from mm_engine.core.structured_output import Grammars
from mm_engine.core.types import CoreOutput, CoreRequest
from mm_engine.frontend.inputs import InputProcessor, find_chat_template
from mm_engine.frontend.output_processor import OutputProcessor
from mm_engine.frontend.thread_tokenizer import PerThreadTokenizer
from mm_engine.frontend.tool_calls import tool_format_for
from mm_engine.outputs import RequestOutput
from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams
from mm_engine.vision.image_io import ImageLimits
from mm_engine.vision.video_io import VideoLimits

IMAGE_TOKEN_FRACTION = 0.25  # of max_model_len: the default max_image_tokens


class Frontend:
    def __init__(
        self, config: EngineConfig, path: Path, hf_config, image_limits: ImageLimits | None = None,
        video_limits: VideoLimits | None = None,
    ) -> None:  # fmt: skip
        """`path`: the resolved checkpoint folder; `hf_config`: its config; `image_limits`: what
        every image is checked against (default `ImageLimits()`)."""
        tokenizer = AutoTokenizer.from_pretrained(path)
        per_thread = PerThreadTokenizer(tokenizer)
        processing = models.make_processing(path, per_thread, hf_config, config.mm_processor_kwargs)
        self.max_model_len: int = config.max_model_len or hf_config.text_config.max_position_embeddings
        # No token is longer than the vocabulary's longest string: text beyond max_model_len of
        # those (twice over, for normalisers that fold characters) cannot fit.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        template = find_chat_template(path, tokenizer)
        self.inputs = InputProcessor(
            per_thread,
            processing,
            template,
            image_limits,
            video_limits,
            max_prompt_chars=2 * self.max_model_len * max(longest, 1),
            grammars=Grammars.for_config(config, per_thread.get, hf_config.text_config.vocab_size),
            tool_format=tool_format_for(hf_config.model_type, template),
            video_group_tokens=config.max_num_encoder_tokens or config.max_num_batched_tokens,
        )
        self.tokenizer = tokenizer  # the detokenizing thread's; the input processor has per-thread copies
        self.output = OutputProcessor(tokenizer)
        self.eos_token_ids = _eos_ids(path, tokenizer)
        if config.max_image_tokens:
            self.max_image_tokens: int = config.max_image_tokens
        elif processing.fixed_tokens is not None:  # LLaVA-1.5: every image the same, no cap needed
            self.max_image_tokens = max(processing.fixed_tokens, self.max_model_len)
        else:  # the image's size decides: one huge upload must not take thousands of tokens unasked
            self.max_image_tokens = max(1, int(self.max_model_len * IMAGE_TOKEN_FRACTION))
        self._seq = itertools.count()

    def request(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> CoreRequest:  # fmt: skip
        """Processed inputs as a request for a core: the caller's id (refused while it is in use)
        or the next number, its EOS ids, its bad words as ids, its arrival. Its outputs are
        expected from now on."""
        request_id = str(next(self._seq)) if request_id is None else str(request_id)
        if request_id in self.output:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self.inputs.bad_words_ids(params.bad_words)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        arrival = time.time()
        self.output.add(request_id, text, ids, params, arrival)
        return CoreRequest(request_id, ids, spans, params, eos, priority, arrival)

    def process_outputs(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """A step's outputs as text, each as its `output_kind` asks, and the ids that a stop string
        ended (their core must abort them)."""
        return self.output.process(outputs)

    def abort(self, request_id: str) -> None:
        self.output.abort(request_id)


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
