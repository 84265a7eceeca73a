"""`POST /v1/chat/completions`, OpenAI-compatible, images as `image_url` content parts and
clips as `video_url` parts (vLLM's extension)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from litestar import Request, Response, post
from litestar.params import JSONBody
from msgspec import UNSET

from mm_engine.api.caller import Caller, HttpCaller
from mm_engine.api.context import ServerContext, get_ctx
from mm_engine.api.errors import APIError, client_errors
from mm_engine.api.limits import (
    check_image_count,
    check_video_count,
    fit_max_tokens,
    request_fields,
    sampling_params,
    structured_outputs_of,
)
from mm_engine.api.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaMessage,
    ImagePart,
    TokenLogprob,
    TopLogprob,
    VideoPart,
)
from mm_engine.api.routes_common import error_responses, json_body
from mm_engine.api.schemas import Usage, sum_usage, usage_of
from mm_engine.api.streaming import DONE, all_last, error_event, merged, sse, sse_response
from mm_engine.api.tools import ToolPlan, delta_calls, message_calls, plan_tools
from mm_engine.frontend.chat_messages import TemplateChat, template_call
from mm_engine.outputs import CompletionOutput, Logprob, RequestOutput
from mm_engine.vision.image_io import ImageError


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")


async def to_engine_messages(
    ctx: ServerContext, messages: list[ChatMessage]
) -> tuple[TemplateChat, list[str]]:
    """The validated messages as the chat template takes them, with their images: `data:` URLs as
    sent (decoded in an input worker), remote images fetched (when allowed) as bytes.

    Also returns where each image came from, so an image error can name its field."""
    where = [
        f"messages[{i}].content[{j}].image_url"
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, ImagePart)
    ]
    clips = [
        part
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
        if isinstance(part, VideoPart)
    ]
    check_image_count(len(where), ctx.settings, "messages")
    check_video_count(len(clips), ctx.settings, "messages")
    out, images, videos = [], [], []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        extra = {}
        if m.tool_calls:
            extra["tool_calls"] = [
                template_call(c.function.name, c.function.arguments, c.id) for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            extra["tool_call_id"] = m.tool_call_id
        if not isinstance(m.content, list):  # a string, or None beside tool calls
            out.append({"role": role, "content": m.content, **extra})
            continue
        parts = []
        for part in m.content:
            if isinstance(part, VideoPart):
                url = part.video_url.url
                if url[:5].lower() != "data:":
                    with client_errors("messages"):
                        url = await ctx.fetcher.fetch(url, "video", ctx.settings.max_video_bytes)
                videos.append(url)
                parts.append({"type": "video"})
                continue
            if not isinstance(part, ImagePart):
                parts.append({"type": "text", "text": part.text})
                continue
            url = part.image_url.url
            if url[:5].lower() == "data:":
                images.append(url)
            else:
                with client_errors(where[len(images)]):
                    images.append(await ctx.fetcher.fetch(url))
            parts.append({"type": "image"})
        out.append({"role": role, "content": parts, **extra})
    return TemplateChat(out, images, videos), where


@post(
    "/v1/chat/completions",
    status_code=200,
    before_request=json_body(ChatCompletionRequest),
    responses=error_responses(),
    summary="Chat completion (OpenAI-compatible)",
    description="With `stream=true` the answer is server-sent events of `chat.completion.chunk` "
    "objects, then `data: [DONE]`. Extra fields (vLLM's): `priority` (lower first), `top_k`, `ignore_eos`, "
    "`repetition_penalty`, `min_p`, `min_tokens`.",
    operation_id="createChatCompletion",
    tags=["openai"],
)
async def create_chat_completion(
    request: Request, data: JSONBody[ChatCompletionRequest]
) -> ChatCompletionResponse:  # or a Stream of server-sent events
    ctx = get_ctx(request)
    return await chat_completion(ctx, data, HttpCaller(request, ctx.clients))


async def chat_completion(
    ctx: ServerContext, data: ChatCompletionRequest, caller: Caller
) -> ChatCompletionResponse | Response:
    """The answer to a chat request (a Stream when it asks for one), for an HTTP client or a batch line."""
    arrival = time.time()
    settings = ctx.settings
    model = ctx.model_name(data.model)
    _refuse_unsupported(data)
    priority = caller.priority(data.priority, settings)
    requested = data.max_completion_tokens or data.max_tokens
    structured = structured_outputs_of(data, data.response_format)
    tools = plan_tools(data, ctx.llm.model_info.tool_format)
    if tools.structured is not None:
        if structured is not None:
            message = (
                "tool_choice required or named holds the answer to a grammar: not with structured output too"
            )
            raise APIError(400, message, param="tool_choice")
        structured = tools.structured
    fields = request_fields(data, settings, (data.top_logprobs or 0) if data.logprobs else None, structured)
    ctx.llm.check_admission()
    messages, where = await to_engine_messages(ctx, data.messages)
    try:
        inputs = await ctx.llm.process_chat(
            messages, tools.tools, data.mm_processor_kwargs, data.chat_template_kwargs
        )
    except ValueError as exc:
        k = exc.index if isinstance(exc, ImageError) and exc.index is not None else -1
        param = where[k] if 0 <= k < len(where) else "messages"
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    param = "max_completion_tokens" if data.max_completion_tokens else "max_tokens"
    max_tokens = fit_max_tokens(requested, len(inputs.token_ids), ctx.llm.model_info.max_model_len,
                                settings, param, "messages")  # fmt: skip
    params = sampling_params(**fields, max_tokens=max_tokens, min_tokens=data.min_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = caller.hold([
        ctx.llm.generate(inputs, child, rid if data.n == 1 else f"{rid}-{j}", priority, arrival)
        for j, child in enumerate(params.children())
    ])  # fmt: skip
    head = _Head(rid, int(arrival), model, bool(data.stream_options and data.stream_options.include_usage),
                 (data.top_logprobs or 0) if data.logprobs else None, tools)  # fmt: skip
    with client_errors(None):
        if not data.stream:
            return head.response(await caller.run(all_last(streams)))
        merge = merged(streams)
        first = await caller.run(anext(merge))
    return sse_response(_events(ctx, head, first, merge, data.n))


class _Head:
    def __init__(
        self, rid: str, created: int, model: str, include_usage: bool, top: int | None, tools: ToolPlan
    ) -> None:
        self.rid, self.created, self.model, self.include_usage = rid, created, model, include_usage
        self.top = top  # top_logprobs per token; None: no logprobs
        self.tools = tools

    def response(self, outs: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for j, o in enumerate(outs):
            content, calls = self.tools.extractor().whole(o.outputs[0].text)
            message = AssistantMessage(content, tool_calls=message_calls(calls) if calls else UNSET)
            reason = _finish_reason(o.outputs[0].finish_reason, bool(calls))
            choices.append(ChatChoice(j, message, reason, self.logprobs(o.outputs[0], o.finished)))
        usage = sum_usage([usage_of(o) for o in outs], len(outs))
        return ChatCompletionResponse(self.rid, self.created, self.model, choices, usage)

    def chunk(
        self, delta: DeltaMessage, finish_reason: str | None = None, logprobs: ChoiceLogprobs | None = None,
        index: int = 0,
    ) -> bytes:  # fmt: skip
        return sse(
            ChatCompletionChunk(
                self.rid, self.created, self.model, [ChunkChoice(index, delta, finish_reason, logprobs)],
                None if self.include_usage else UNSET,
            )
        )  # fmt: skip

    def logprobs(self, c: CompletionOutput, finished: bool) -> ChoiceLogprobs | None:
        """OpenAI's shape of a completion's logprobs; the EOS or stop token that ended it is not
        part of the content, so neither is its logprob."""
        if self.top is None or c.logprobs is None:
            return None
        entries = c.logprobs
        if finished and c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and entries:
            entries = entries[:-1]
        return ChoiceLogprobs([_token_logprob(e, self.top) for e in entries])

    def usage_chunk(self, usages: list[Usage]) -> bytes:
        return sse(
            ChatCompletionChunk(self.rid, self.created, self.model, [], sum_usage(usages, len(usages)))
        )


async def _events(
    ctx: ServerContext, head: _Head, first: tuple[int, RequestOutput], merge: AsyncIterator, n: int
) -> AsyncIterator[bytes]:
    """The choices' chunks as they come (`first` taken already, so an early error was a status)."""
    try:
        for j in range(n):
            yield head.chunk(DeltaMessage(role="assistant", content=""), index=j)
        generated, usages, item = [0] * n, {}, first
        extractors = [head.tools.extractor() for _ in range(n)]
        while True:
            j, out = item
            generated[j] += len(out.outputs[0].token_ids)  # outputs are deltas
            logprobs = head.logprobs(out.outputs[0], out.finished)
            calls_before = extractors[j].num_calls
            content, calls = extractors[j].feed(out.delta_text or "")
            if out.finished:
                rest, more = extractors[j].flush()
                content, calls = content + rest, calls + more
            if content or calls or out.finished or (logprobs is not None and logprobs.content):
                reason = (
                    _finish_reason(out.outputs[0].finish_reason, extractors[j].num_calls > 0)
                    if out.finished
                    else None
                )
                delta = DeltaMessage(
                    content=content or None, tool_calls=delta_calls(calls, calls_before) or None
                )
                yield head.chunk(delta, reason, logprobs, j)
            if out.finished:
                usages[j] = usage_of(out, generated[j])
                if len(usages) == n:
                    break
            item = await anext(merge)
        if head.include_usage:
            yield head.usage_chunk([usages[j] for j in range(n)])
    except Exception as exc:  # the status line is gone already: report it in the stream
        yield error_event(exc, ctx.settings.retry_after_seconds)
    finally:
        await merge.aclose()  # no-op when finished; aborts the requests when the client left
    yield DONE


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended on its own after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def _token_logprob(entry: dict[int, Logprob], top: int) -> TokenLogprob:
    """One token's entry: the sampled token comes first in the engine's dict, then the top ones."""
    sampled = next(iter(entry.values()))
    best = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
    tops = [TopLogprob(lp.decoded_token, lp.logprob, list(lp.decoded_token.encode())) for lp in best]
    return TokenLogprob(sampled.decoded_token, sampled.logprob, list(sampled.decoded_token.encode()), tops)
