"""`GET /v1/models`, `GET /v1/models/{model}`, `GET /health`, `GET /metrics`, and `GET /` (the
playground page)."""

from __future__ import annotations

from pathlib import Path

from litestar import MediaType, Request, Response, get, head
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath
from prometheus_client import CONTENT_TYPE_LATEST

from mm_engine.api.context import get_ctx
from mm_engine.api.errors import APIError
from mm_engine.api.routes_common import error_responses
from mm_engine.api.schemas import HealthResponse, ModelCard, ModelList, PlatformInfo


def _card(request: Request, name: str) -> ModelCard:
    ctx = get_ctx(request)
    return ModelCard(name, ctx.created, ctx.llm.model_info.max_model_len)


@get("/v1/models", summary="List the served models", operation_id="listModels", tags=["openai"])
async def list_models(request: Request) -> ModelList:
    return ModelList([_card(request, name) for name in get_ctx(request).settings.served_model_names])


@get(
    "/v1/models/{model:str}",
    summary="Describe one served model",
    operation_id="retrieveModel",
    tags=["openai"],
    responses=error_responses(404),
)
async def retrieve_model(request: Request, model: FromPath[str]) -> ModelCard:
    if model not in get_ctx(request).settings.served_model_names:
        raise APIError(
            404, f"the model {model[:200]!r} does not exist", param="model", code="model_not_found"
        )
    return _card(request, model)


@get(
    "/health",
    summary="Liveness of the engine loop",
    description="200 while the engine loop makes progress; 503 when it is dead, stalled, draining, "
    "or its last step failed.",
    operation_id="health",
    tags=["server"],
    responses={503: ResponseSpec(data_container=HealthResponse, description="Not healthy")},
)
async def health(request: Request) -> Response[HealthResponse]:
    ctx = get_ctx(request)
    h = ctx.llm.health()
    body = HealthResponse(
        status=h.status,
        engine_loop_alive=h.alive,
        draining=h.draining,
        seconds_since_progress=round(h.seconds_since_progress, 3),
        faults_total=h.faults_total,
        last_error=h.last_error,
        num_unfinished_requests=h.num_unfinished,
        platform=PlatformInfo(**ctx.llm.platform_info()),
        api_server=ctx.settings.api_server_index,
    )
    if h.ok:
        return Response(body, status_code=200)
    headers = {"Retry-After": str(ctx.settings.retry_after_seconds)} if h.draining else None
    return Response(body, status_code=503, headers=headers)


@head("/health", operation_id="health_head", tags=["server"], include_in_schema=False)
async def health_head(request: Request) -> Response[None]:
    """`HEAD /health`: the status of `GET /health` without its body (load balancers probe so)."""
    ctx = get_ctx(request)
    h = ctx.llm.health()
    return Response(None, status_code=200 if h.ok else 503)


@get(
    "/metrics",
    summary="Prometheus metrics",
    operation_id="metrics",
    tags=["server"],
    media_type="text/plain",
    include_in_schema=True,
)
async def metrics(request: Request) -> Response[bytes]:
    ctx = get_ctx(request)
    body = ctx.metrics.render(ctx.llm.stats(), ctx.llm.platform_info())
    return Response(body, media_type=CONTENT_TYPE_LATEST)


_PLAYGROUND = Path(__file__).with_name("playground.html")
# Only what the page itself carries: no external script, style, font or connection.
_PLAYGROUND_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'"
)


@get("/", operation_id="playground", include_in_schema=False, media_type=MediaType.HTML)
async def playground() -> Response[bytes]:
    """The built-in playground: chat with images, streaming, TTFT and tokens/s, JSON mode."""
    return Response(_PLAYGROUND.read_bytes(), media_type=MediaType.HTML,
                    headers={"content-security-policy": _PLAYGROUND_CSP})  # fmt: skip
