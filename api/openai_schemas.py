"""OpenAI chat-completions wire format (the subset we serve, plus vLLM-style extras)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from mm_engine.api.schemas import MaxTokens, Priority, Seed, TokenId, TopP, Usage
from mm_engine.sampling_params import MAX_BAD_WORDS


class ImageURL(Struct, forbid_unknown_fields=True):
    url: str  # data:image/...;base64,...; http(s) only for hosts in --allowed-media-domains
    detail: str | None = None  # accepted for compatibility; images are always used at full detail


class TextPart(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ImagePart(Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True):
    image_url: ImageURL


class VideoURL(Struct, forbid_unknown_fields=True):
    url: str  # data:video/...;base64,...; http(s) only for hosts in --allowed-media-domains


class VideoPart(Struct, tag_field="type", tag="video_url", forbid_unknown_fields=True):
    video_url: VideoURL


ContentPart = TextPart | ImagePart | VideoPart


class CalledFunction(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # the arguments object as JSON text


class MessageToolCall(Struct, forbid_unknown_fields=True):
    id: str
    function: CalledFunction
    type: Literal["function"] = "function"


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # OpenAI refuses `[]` too; None only for an assistant message that has tool_calls.
    content: str | Annotated[list[ContentPart], Meta(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    def __post_init__(self) -> None:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (null only in an assistant message with tool_calls)")


FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
BadWord = Annotated[str, Meta(min_length=1, max_length=200)]


class FunctionDef(Struct, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class StructuredOutputsField(Struct, forbid_unknown_fields=True):
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None


class JSONSchemaFormat(Struct, forbid_unknown_fields=True):
    name: str = "schema"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
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
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=1024)] | None = None
    bad_words: Annotated[list[BadWord], Meta(max_length=MAX_BAD_WORDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Image processor options for this request's images, over the server's (e.g. max_pixels).
    mm_processor_kwargs: dict[str, Any] | None = None
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
    # Function tools (families with a tool-call format; a 400 for the others). tool_choice:
    # "auto" (the default with tools), "none", "required", or a named function.
    tools: Annotated[list[ToolDef], Meta(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Extra variables for the chat template (e.g. enable_thinking), as vLLM's.
    chat_template_kwargs: dict[str, Any] | None = None


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[MessageToolCall] | UnsetType = UNSET  # only when the model called tools


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


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    index: int  # of the call within its choice
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
