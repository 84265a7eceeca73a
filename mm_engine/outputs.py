"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput` so users can switch engines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log probability, its rank among all (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With SamplingParams(logprobs=k): per token, the sampled one first, then the top k.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    delta_text: str = ""  # text new since the previous output of this request (for streaming)
    # With SamplingParams(prompt_logprobs=k): per prompt token (None for the first and for image
    # positions) a dict of token id to Logprob, the prompt's token first, then the top k.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)
