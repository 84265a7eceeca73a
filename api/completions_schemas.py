"""OpenAI's legacy completions wire format (`POST /v1/completions`) and vLLM's `/tokenize` and
`/detokenize`: the subset we serve, with the same vLLM-style extras as chat."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import UNSET, Meta, Struct, UnsetType

from mm_engine.api.openai_schemas import ChatMessage, SamplingFields
from mm_engine.api.schemas import Usage


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings (one choice each), a list of token ids, or a list of those.
    prompt: str | Annotated[list[Any], Meta(min_length=1, max_length=1_000_000)]
    best_of: Annotated[int, Meta(ge=1, le=128)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: Any = UNSET  # refused by name: no insertion


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    system_fingerprint: str | None = None


class CompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"


class TokenizeRequest(Struct, forbid_unknown_fields=True):
    """vLLM's: a `prompt`, or chat `messages` (then the chat template, image tokens expanded)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, forbid_unknown_fields=True):
    tokens: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=1_000_000)]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str
