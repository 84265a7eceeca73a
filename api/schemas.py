"""Wire schemas shared by the routes, and the caption route's own (msgspec Structs throughout)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar.datastructures import UploadFile
from msgspec import Meta, Struct

from mm_engine.outputs import RequestOutput

# Bounds that keep values inside what the engine and torch accept (a seed must fit 64 bits).
MaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1, description="lower is served first")]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorDetail


class PromptTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def sum_usage(usages: list[Usage], n: int = 1) -> Usage:
    """Several requests' usage as one, as OpenAI counts it: `usages` in choice order, `n` samples
    per prompt, whose prompt counts once (prompt i's sample j is choice i * n + j)."""
    firsts = usages[::n]
    p, c = sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in firsts if u.prompt_tokens_details)
    return Usage(p, c, p + c, PromptTokensDetails(cached))


def usage_of(out: RequestOutput, completion_tokens: int | None = None) -> Usage:
    """Usage of a finished request; `completion_tokens` where `out` is a delta."""
    p = len(out.prompt_token_ids)
    c = len(out.outputs[0].token_ids) if completion_tokens is None else completion_tokens
    return Usage(p, c, p + c, PromptTokensDetails(out.num_cached_tokens))


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "mm-engine"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class PlatformInfo(Struct):
    device: str  # "cpu" or "cuda"
    attention_backend: str  # "cpu", "torch" or "triton"
    cpu_variant: str | None  # the C kernels' ISA variant ("avx512", "avx2", "portable"), or None
    cpu_kernels: list[str]  # the C kernels in use
    quantization: str | None = None  # the language model's linears rounded on load ("int4", ...)
    quantized_lm_head: bool = False
    quantized_compute: str | None = None  # "qgemm-<variant>" (the CPU's low-bit GEMM) or "dequantize"


class HealthResponse(Struct):
    status: str  # "ok", "draining", "stalled", "faulted" or "dead"
    engine_loop_alive: bool
    draining: bool
    seconds_since_progress: float
    faults_total: int
    last_error: str | None
    num_unfinished_requests: int
    platform: PlatformInfo
    api_server: int = 0  # which API server answered (--api-server-count)


class CaptionForm(Struct, forbid_unknown_fields=True):
    """`multipart/form-data` fields of `POST /v1/caption`; `image` and `video` may be repeated
    (at least one of them)."""

    image: list[UploadFile] = []
    video: list[UploadFile] = []
    prompt: str | None = None
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 0.0  # captions are greedy unless asked otherwise
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: list[str] | None = None  # repeat the field for several stop strings
    priority: Priority = 0
    stream: bool = False
    ignore_eos: bool = False  # as in the chat API: run to max_tokens (benchmarks)


class CaptionResponse(Struct):
    id: str
    created: int
    model: str
    text: str
    finish_reason: str | None
    usage: Usage
    object: str = "caption"


class CaptionChunk(Struct):
    """One server-sent event of a streamed caption: `text` is the new text since the last one."""

    id: str
    created: int
    model: str
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None  # on the last chunk only
    object: str = "caption.chunk"


encoder = msgspec.json.Encoder()
