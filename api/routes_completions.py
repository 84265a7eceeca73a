"""`POST /v1/completions` (OpenAI's legacy completions: prompt strings or token ids, streamed or
not), and vLLM's `POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from litestar import Request, Response, post
from litestar.params import JSONBody
from msgspec import UNSET

from mm_engine.api.caller import Caller, HttpCaller
from mm_engine.api.completions_schemas import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from mm_engine.api.context import ServerContext, get_ctx
from mm_engine.api.errors import APIError, client_errors
from mm_engine.api.limits import (
    fit_max_tokens,
    request_fields,
    sampling_params,
    structured_outputs_of,
)
from mm_engine.api.routes_chat import to_engine_messages
from mm_engine.api.routes_common import error_responses, json_body
from mm_engine.api.schemas import Usage, sum_usage, usage_of
from mm_engine.api.settings import ServerSettings
from mm_engine.api.streaming import DONE, all_last, error_event, merged, sse, sse_response
from mm_engine.frontend.detokenizer import IncrementalDetokenizer
from mm_engine.outputs import CompletionOutput, RequestOutput
from mm_engine.sampling_params import SamplingParams


def _refuse_unsupported(body: CompletionRequest) -> None:
    if body.best_of not in (None, 1):
        raise APIError(400, "only best_of=1 is supported", param="best_of", code="unsupported_value")
    if body.suffix is not UNSET and body.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.echo and body.logprobs is not None:
        message = "echo with logprobs needs prompt logprobs, which are not supported yet"
        raise APIError(400, message, param="echo", code="unsupported_value")


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31


def _prompts(prompt: str | list, settings: ServerSettings) -> list[dict]:
    """Each prompt as the engine takes it: a string, or token ids (a flat list is one prompt)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if all(_is_id(t) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if len(prompt) > settings.max_prompts_per_request:
        most = settings.max_prompts_per_request
        raise APIError(400, f"at most {most} prompts per request, got {len(prompt)}", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, token ids (0 to 2**31 - 1) or lists "
                   "of token ids", param="prompt", code="invalid_value")  # fmt: skip


@post(
    "/v1/completions",
    status_code=200,
    before_request=json_body(CompletionRequest),
    responses=error_responses(),
    summary="Text completion (OpenAI-compatible, legacy)",
    description="A prompt string, token ids, or a list of either (one choice each, `index` in "
    "order). With `stream=true`, server-sent events of `text_completion` chunks, then "
    "`data: [DONE]`. Extras as in chat.",
    operation_id="createCompletion",
    tags=["openai"],
)
async def create_completion(
    request: Request, data: JSONBody[CompletionRequest]
) -> CompletionResponse:  # or a Stream of server-sent events
    ctx = get_ctx(request)
    return await completion(ctx, data, HttpCaller(request, ctx.clients))


async def completion(
    ctx: ServerContext, data: CompletionRequest, caller: Caller
) -> CompletionResponse | Response:
    """The answer to a completions request (a Stream when it asks for one), for an HTTP client or a
    batch line."""
    arrival = time.time()
    settings = ctx.settings
    model = ctx.model_name(data.model)
    _refuse_unsupported(data)
    priority = caller.priority(data.priority, settings)
    prompts = _prompts(data.prompt, settings)
    if len(prompts) * data.n > settings.max_sequences_per_request:
        message = (f"{len(prompts)} prompts x n={data.n} is {len(prompts) * data.n} sequences, more than "
                   f"{settings.max_sequences_per_request} per request")  # fmt: skip
        raise APIError(400, message, param="n")
    if data.mm_processor_kwargs is not None:
        prompts = [{**p, "mm_processor_kwargs": data.mm_processor_kwargs} for p in prompts]
    fields = request_fields(data, settings, data.logprobs, structured_outputs_of(data))
    ctx.llm.check_admission()
    rid = f"cmpl-{uuid.uuid4().hex}"
    gens, inputs_all = [], []
    for prompt in prompts:
        try:
            inputs = await ctx.llm.process_prompt(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
        max_tokens = fit_max_tokens(data.max_tokens, len(inputs.token_ids), ctx.llm.model_info.max_model_len,
                                    settings, "max_tokens", "prompt")  # fmt: skip
        params = sampling_params(**fields, max_tokens=max_tokens, min_tokens=data.min_tokens)
        echoed = await _echo_text(ctx, inputs) if data.echo else ""
        for child in params.children():  # choice index: prompt i's sample j is i * n + j
            inputs_all.append(echoed)
            gens.append((inputs, child))
    echo = inputs_all
    streams = caller.hold(
        [ctx.llm.generate(x, p, f"{rid}-{i}", priority, arrival) for i, (x, p) in enumerate(gens)]
    )
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    head = _Head(rid, int(arrival), model, include_usage, echo, data.logprobs, data.n)
    with client_errors(None):
        if not data.stream:
            outs = await caller.run(all_last(streams))
            if data.logprobs is not None:
                head.offsets = [
                    await _token_offsets(ctx, out.outputs[0].token_ids, len(e))
                    for out, e in zip(outs, echo, strict=True)
                ]
            return head.response(outs)
    return sse_response(_events(ctx, head, streams))


async def _token_offsets(ctx: ServerContext, ids: list[int], start: int) -> list[int]:
    """Where each token's text starts in the choice's text: the length of the text before it,
    decoded incrementally (a token that ends a split character starts where the character does)."""
    tokenizer = ctx.llm.inputs.tokenizer

    def offsets() -> list[int]:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(max_tokens=1))
        out, length = [], start
        for token in ids:
            out.append(length)
            length += len(detok.step([token]))
        return out

    return await ctx.llm.run_in_worker(offsets, weight=len(ids))


async def _echo_text(ctx: ServerContext, inputs) -> str:
    if inputs.text is not None:
        return inputs.text
    tokenizer = ctx.llm.inputs.tokenizer
    return await ctx.llm.run_in_worker(lambda: tokenizer.decode(inputs.token_ids))


class _Head:
    def __init__(
        self, rid: str, created: int, model: str, include_usage: bool, echo: list[str], top: int | None,
        n: int,
    ) -> None:  # fmt: skip
        self.rid, self.created, self.model = rid, created, model
        self.include_usage, self.echo, self.top = include_usage, echo, top
        self.n = n  # samples per prompt
        # Per choice: each token's text_offset (not streamed), or the text's length so far (streamed).
        self.offsets: list = [len(e) for e in echo]

    def response(self, outs: list[RequestOutput]) -> CompletionResponse:
        choices = [
            CompletionChoice(i, self.echo[i] + o.outputs[0].text, o.outputs[0].finish_reason,
                             self.logprobs(i, o.outputs[0], True))
            for i, o in enumerate(outs)
        ]  # fmt: skip
        usage = sum_usage([usage_of(o) for o in outs], self.n)
        return CompletionResponse(self.rid, self.created, self.model, choices, usage)

    def logprobs(self, i: int, c: CompletionOutput, finished: bool) -> CompletionLogprobs | None:
        """The legacy shape; the EOS or stop token that ended it is not in the text, so not here."""
        if c.logprobs is None:
            return None
        entries = c.logprobs
        if finished and c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and entries:
            entries = entries[:-1]
        out = CompletionLogprobs([], [], [], [])
        for j, entry in enumerate(entries):
            sampled = next(iter(entry.values()))
            out.tokens.append(sampled.decoded_token)
            out.token_logprobs.append(sampled.logprob)
            top = sorted(entry.values(), key=lambda lp: lp.rank)[: self.top]
            out.top_logprobs.append({lp.decoded_token: lp.logprob for lp in top})
            at = self.offsets[i]
            out.text_offset.append(at[j] if isinstance(at, list) else at)  # streamed: where the delta starts
        return out

    def chunk(self, i: int, text: str, reason: str | None, logprobs: CompletionLogprobs | None) -> bytes:
        choice = CompletionChoice(i, text, reason, logprobs)
        usage = None if self.include_usage else UNSET
        return sse(CompletionChunk(self.rid, self.created, self.model, [choice], usage))


async def _events(
    ctx: ServerContext, head: _Head, streams: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[bytes]:
    """Every choice's stream, merged in the order the outputs come."""
    usage: dict[int, Usage] = {}
    generated = [0] * len(streams)
    merge = merged(streams)
    try:
        for i, e in enumerate(head.echo):
            if e:
                yield head.chunk(i, e, None, None)
        async for i, out in merge:
            generated[i] += len(out.outputs[0].token_ids)  # outputs are deltas
            logprobs = head.logprobs(i, out.outputs[0], out.finished)
            if out.delta_text or out.finished or (logprobs is not None and logprobs.tokens):
                reason = out.outputs[0].finish_reason if out.finished else None
                yield head.chunk(i, out.delta_text, reason, logprobs)
            head.offsets[i] += len(out.delta_text)
            if out.finished:
                usage[i] = usage_of(out, generated[i])
        if head.include_usage and usage:
            total = sum_usage([usage[i] for i in sorted(usage)], head.n)
            yield sse(CompletionChunk(head.rid, head.created, head.model, [], total))
    except Exception as exc:  # the status line is gone already: report it in the stream
        yield error_event(exc, ctx.settings.retry_after_seconds)
    finally:
        await merge.aclose()  # aborts what is still running (the client left, or one failed)
    yield DONE


@post("/tokenize", status_code=200, before_request=json_body(TokenizeRequest),
      responses=error_responses(), summary="Tokenize a prompt or chat messages (vLLM's)",
      description="A `prompt`, or `messages` through the chat template (image tokens expanded).",
      operation_id="tokenize", tags=["vllm"])  # fmt: skip
async def tokenize(request: Request, data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
    ctx = get_ctx(request)
    ctx.model_name(data.model)
    if (data.prompt is None) == (data.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if data.messages is not None:
        engine_messages, _ = await to_engine_messages(ctx, data.messages)
        with client_errors("messages"):
            ids = (await ctx.llm.process_chat(engine_messages)).token_ids
    else:
        tokenizer, text = ctx.llm.inputs.tokenizer, data.prompt
        with client_errors("prompt"):
            ctx.llm.inputs.check_length(len(text))
        special = data.add_special_tokens
        ids = await ctx.llm.run_in_worker(lambda: tokenizer(text, add_special_tokens=special)["input_ids"])
    strs = None
    if data.return_token_strs:
        tokenizer = ctx.llm.inputs.tokenizer
        strs = await ctx.llm.run_in_worker(lambda: tokenizer.convert_ids_to_tokens(ids))
    return TokenizeResponse(len(ids), ctx.llm.model_info.max_model_len, ids, strs)


@post("/detokenize", status_code=200, before_request=json_body(DetokenizeRequest),
      responses=error_responses(), summary="Token ids back to text (vLLM's)", operation_id="detokenize",
      tags=["vllm"])  # fmt: skip
async def detokenize(request: Request, data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
    ctx = get_ctx(request)
    ctx.model_name(data.model)
    tokenizer = ctx.llm.inputs.tokenizer
    vocab = len(tokenizer.get())
    bad = next((t for t in data.tokens if t >= vocab), None)
    if bad is not None:
        message = f"token {bad} is not a token id of this model (0 .. {vocab - 1})"
        raise APIError(400, message, param="tokens", code="invalid_value")
    text = await ctx.llm.run_in_worker(lambda: tokenizer.decode(data.tokens), weight=len(data.tokens))
    return DetokenizeResponse(text)
