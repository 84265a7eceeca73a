"""The Batch API: `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{batch_id}`,
`POST /v1/batches/{batch_id}/cancel`. A batch is written to disk in `validating`; the server's
BatchRunner (batch/runner.py) takes it from there."""

from __future__ import annotations

import re
import time

from litestar import Request, get, post
from litestar.params import FromPath, FromQuery, JSONBody, Parameter

from mm_engine.api.context import get_ctx
from mm_engine.api.errors import APIError
from mm_engine.api.routes_common import error_responses, json_body
from mm_engine.api.routes_files import file_store
from mm_engine.batch.files import new_file_id
from mm_engine.batch.schemas import ACTIVE, ENDPOINTS, Batch, BatchList, CreateBatch, page_of
from mm_engine.batch.store import BatchState, new_batch_id

_WINDOW = re.compile(r"([1-9][0-9]{0,3})([mh])")  # OpenAI's "24h"; any minutes or hours up to a week
MAX_WINDOW_S = 7 * 24 * 3600


def _window_seconds(window: str) -> int:
    match = _WINDOW.fullmatch(window)
    seconds = int(match[1]) * (60 if match[2] == "m" else 3600) if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        message = (
            f"completion_window must be like '24h' (hours or minutes, at most a week), got {window[:20]!r}"
        )
        raise APIError(400, message, param="completion_window")
    return seconds


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        message = "metadata holds at most 16 pairs, keys up to 64 characters, values up to 512"
        raise APIError(400, message, param="metadata")


def _runner(request: Request):
    ctx = get_ctx(request)
    file_store(ctx)  # 404 when the batch API is off
    return ctx.batches


def _load(runner, batch_id: str) -> Batch:
    try:
        return runner.store.view(batch_id)
    except LookupError:
        raise APIError(
            404, f"no batch {batch_id[:100]!r}", param="batch_id", code="batch_not_found"
        ) from None


@post(
    "/v1/batches",
    status_code=200,
    before_request=json_body(CreateBatch),
    responses=error_responses(400, 404, 415),
    summary="Create a batch from an uploaded file of requests",
    operation_id="createBatch",
    tags=["batch"],
)
async def create_batch(request: Request, data: JSONBody[CreateBatch]) -> Batch:
    runner = _runner(request)
    if data.endpoint not in ENDPOINTS:
        message = f"endpoint must be one of {', '.join(ENDPOINTS)}, got {data.endpoint[:100]!r}"
        raise APIError(400, message, param="endpoint", code="unsupported_value")
    window = _window_seconds(data.completion_window)
    _check_metadata(data.metadata)
    try:
        source = runner.files.get(data.input_file_id)
    except LookupError:
        message = f"no file {data.input_file_id[:100]!r}"
        raise APIError(404, message, param="input_file_id", code="file_not_found") from None
    if source.purpose != "batch":
        raise APIError(400, "the input file's purpose must be 'batch'", param="input_file_id")
    now = int(time.time())
    model = get_ctx(request).settings.served_model_names[0]
    batch = Batch(
        id=new_batch_id(), endpoint=data.endpoint, input_file_id=source.id,
        completion_window=data.completion_window, status="validating", created_at=now,
        expires_at=now + window, metadata=data.metadata, model=model,
    )  # fmt: skip
    runner.store.save(BatchState(batch, new_file_id(), new_file_id()))
    runner.wake()
    return batch


@get("/v1/batches", summary="List batches, newest first", operation_id="listBatches", tags=["batch"])
async def list_batches(
    request: Request, after: FromQuery[str | None] = None, limit: int = Parameter(default=20, ge=1, le=100)
) -> BatchList:
    runner = _runner(request)
    found = [runner.store.view(s.batch.id) for s in reversed(runner.store.all())]
    return BatchList(*page_of(found, after, limit))


@get("/v1/batches/{batch_id:str}", summary="A batch", operation_id="retrieveBatch", tags=["batch"])
async def retrieve_batch(request: Request, batch_id: FromPath[str]) -> Batch:
    return _load(_runner(request), batch_id)


@post(
    "/v1/batches/{batch_id:str}/cancel",
    status_code=200,
    responses=error_responses(404),
    summary="Cancel a batch (requests in flight are aborted; what finished stays in its files)",
    operation_id="cancelBatch",
    tags=["batch"],
)
async def cancel_batch(request: Request, batch_id: FromPath[str]) -> Batch:
    runner = _runner(request)
    batch = _load(runner, batch_id)
    if batch.status not in (*ACTIVE, "cancelling"):
        message = f"the batch is {batch.status}: only a batch still running can be cancelled"
        raise APIError(409, message, param="batch_id", code="batch_not_cancellable")
    runner.store.request_cancel(batch.id)
    runner.wake()
    return runner.store.view(batch.id)
