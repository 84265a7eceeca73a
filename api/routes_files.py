"""The Files API for batches: `POST /v1/files` (multipart: `file`, `purpose=batch`), `GET /v1/files`,
`GET /v1/files/{file_id}`, `GET /v1/files/{file_id}/content`, `DELETE /v1/files/{file_id}`.

An upload streams to disk as it arrives, capped by `--max-batch-file-bytes` and by what the batch
folder may hold in all (`--max-batch-storage-bytes`); nothing of it is held whole in memory."""

from __future__ import annotations

from typing import Literal

from litestar import Request, delete, get, post
from litestar.params import FromPath, FromQuery, Parameter
from litestar.response import File

from mm_engine.api.context import ServerContext, get_ctx
from mm_engine.api.errors import APIError
from mm_engine.api.routes_common import error_responses
from mm_engine.batch.files import FileStore, new_file_id
from mm_engine.batch.multipart import MultipartError, boundary_of, save_upload
from mm_engine.batch.schemas import FileDeleted, FileList, FileObject, page_of

MAX_FILENAME = 255


def file_store(ctx: ServerContext) -> FileStore:
    if ctx.batches is None:
        raise APIError(
            404, "the batch API is off on this server (start it with --batch-dir)", code="not_found"
        )
    return ctx.batches.files


def _get(files: FileStore, file_id: str) -> FileObject:
    try:
        return files.get(file_id)
    except LookupError:
        raise APIError(404, f"no file {file_id[:100]!r}", param="file_id", code="file_not_found") from None


@post(
    "/v1/files",
    status_code=200,
    request_max_body_size=None,  # the upload is capped as it streams (below), not by the app's limit
    responses=error_responses(400, 413, 415, 503),
    summary="Upload a file of batch requests (multipart: file, purpose=batch)",
    operation_id="createFile",
    tags=["batch"],
)
async def create_file(request: Request) -> FileObject:
    ctx = get_ctx(request)
    files = file_store(ctx)
    settings = ctx.settings
    try:
        boundary = boundary_of(request.headers.get("content-type", ""))
    except MultipartError as exc:
        raise APIError(415, str(exc)) from None
    room = settings.max_batch_storage_bytes - files.used_bytes()
    limit = min(settings.max_batch_file_bytes, room)
    if limit <= 0:
        raise APIError(413, "the server's batch storage is full: delete files first", code="storage_full")
    tmp = files.upload_path()
    try:
        try:
            upload = await save_upload(request.stream(), boundary, "file", tmp, limit)
        except MultipartError as exc:
            status = 413 if "over the limit" in str(exc) else 400
            raise APIError(status, str(exc), param="file") from None
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch', got {(purpose or '')[:50]!r}", param="purpose")
        name = upload.filename.replace("\\", "/").rsplit("/", 1)[-1][:MAX_FILENAME] or "upload.jsonl"
        return files.publish(new_file_id(), name, purpose, source=tmp)
    finally:
        tmp.unlink(missing_ok=True)


@get("/v1/files", summary="List files", operation_id="listFiles", tags=["batch"])
async def list_files(
    request: Request,
    purpose: FromQuery[str | None] = None,
    limit: int = Parameter(default=10000, ge=1, le=10000),
    order: FromQuery[Literal["asc", "desc"]] = "desc",
    after: FromQuery[str | None] = None,
) -> FileList:
    found = file_store(get_ctx(request)).list(purpose)
    if order == "desc":
        found.reverse()
    return FileList(*page_of(found, after, limit))


@get("/v1/files/{file_id:str}", summary="A file's description", operation_id="retrieveFile", tags=["batch"])
async def retrieve_file(request: Request, file_id: FromPath[str]) -> FileObject:
    return _get(file_store(get_ctx(request)), file_id)


@get(
    "/v1/files/{file_id:str}/content",
    summary="A file's bytes",
    operation_id="downloadFile",
    tags=["batch"],
    media_type="application/octet-stream",
)
async def file_content(request: Request, file_id: FromPath[str]) -> File:
    files = file_store(get_ctx(request))
    obj = _get(files, file_id)
    return File(files.data_path(obj.id), filename=obj.filename, media_type="application/octet-stream")


@delete("/v1/files/{file_id:str}", status_code=200, summary="Delete a file", operation_id="deleteFile",
        tags=["batch"])  # fmt: skip
async def delete_file(request: Request, file_id: FromPath[str]) -> FileDeleted:
    ctx = get_ctx(request)
    files = file_store(ctx)
    obj = _get(files, file_id)
    if obj.purpose == "batch" and ctx.batches.uses_input(obj.id):
        raise APIError(
            409, "a batch that is not finished reads this file", param="file_id", code="file_in_use"
        )
    files.delete(obj.id)
    return FileDeleted(obj.id)
