"""What the frontend builds from a checkpoint: the tokenizer, the input processor (chat template,
the family's image processing) and the limits that depend on them. In-process (`LLMEngine`) and
in front of an engine-core process alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

from mm_engine import models
from mm_engine.config import EngineConfig
from mm_engine.inputs import InputProcessor, find_chat_template
from mm_engine.thread_tokenizer import PerThreadTokenizer

IMAGE_TOKEN_FRACTION = 0.25  # of max_model_len: the default max_image_tokens


@dataclass(slots=True)
class Frontend:
    tokenizer: object  # for the thread that detokenizes; the input processor has per-thread copies
    inputs: InputProcessor
    eos_token_ids: frozenset[int]
    max_model_len: int
    max_image_tokens: int


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
