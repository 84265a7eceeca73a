"""OpenAI chat-completions wire format (the subset we serve, plus vLLM-style extras)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from mm_engine.api.schemas import MaxTokens, Priority, Seed, TopP, Usage


class ImageURL(Struct):
    url: str  # data:image/...;base64,...; http(s) only for hosts in --allowed-media-domains
    detail: str | None = None  # accepted for compatibility; images are always used at full detail


class TextPart(Struct, tag_field="type", tag="text"):
    text: str


class ImagePart(Struct, tag_field="type", tag="image_url"):
    image_url: ImageURL


ContentPart = TextPart | ImagePart


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Meta(min_length=1)]  # OpenAI refuses `[]` too
    name: str | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class StructuredOutputsField(Struct, forbid_unknown_fields=True):
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None


class JSONSchemaFormat(Struct):
    name: str = "schema"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True):
    """What chat and completions requests share: the model, sampling, streaming and the extras."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    # Extras (vLLM names): send them with the openai client's `extra_body`.
    priority: Priority = 0
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    # Structured output (vLLM's names): one of these, or chat's response_format.
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # needs logprobs: true
    response_format: ResponseFormat | None = None
    # Not implemented yet: refused by name when sent (never silently dropped), whatever their value.
    tools: Any = UNSET
    tool_choice: Any = UNSET


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    # With stream_options.include_usage every chunk carries "usage": null but the last (choices
    # empty) which carries the totals; without it the field is left out.
    usage: Usage | None | UnsetType = UNSET
    object: str = "chat.completion.chunk"
