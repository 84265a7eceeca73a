"""What goes into the engine core and what comes out of one step: plain values, no tokenizer
state, so that they cross a process boundary as they are (core/messages.py encodes them)."""

from __future__ import annotations

from dataclasses import dataclass

from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class CoreRequest:
    request_id: str
    token_ids: list[int]  # the prompt, image placeholders expanded
    images: list[ImageSpan]
    params: SamplingParams
    eos_token_ids: frozenset[int]  # empty for ignore_eos
    priority: int = 0
    arrival_time: float = 0.0


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's logprob and rank (1: the most likely), and the top alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class CoreOutput:
    """One request's progress in one step: the tokens it gained, and why it ended, if it did.

    The core ends a request on EOS, a stop token id, max_tokens or max_model_len; stop strings
    are the frontend's (it detokenizes), which then aborts the request here."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length"; None: running
    stop_token: int | None = None  # the stop token id that ended it (not EOS)
    ended_by_token: bool = False  # its last token is EOS or a stop token: not part of the text
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, where the request asked
    # With the first token, where asked: per prompt position (None for the first, and for image
    # positions, whose ids are placeholders), the logprob of that prompt token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
