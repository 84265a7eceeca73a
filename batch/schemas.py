"""The Batch API's objects, in OpenAI's shapes (what `openai.types.Batch` and `FileObject` read)."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct, field

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
ACTIVE = ("validating", "in_progress", "finalizing")  # a runner still has work on these
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # "batch" (uploads) or "batch_output" (a batch's output and error files)
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


def page_of(items: list, after: str | None, limit: int) -> tuple[list, bool, str | None, str | None]:
    """Cursor pagination as OpenAI lists do it: the items after the one whose id is `after`, at most
    `limit`; (page, has_more, first_id, last_id)."""
    if after is not None:
        at = next((i for i, x in enumerate(items) if x.id == after), None)
        items = items[at + 1 :] if at is not None else []
    page = items[:limit]
    return page, len(items) > limit, page[0].id if page else None, page[-1].id if page else None


class FileList(Struct):
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: str = "list"


class FileDeleted(Struct):
    id: str
    deleted: bool = True
    object: str = "file"


class RequestCounts(Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(Struct):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(Struct):
    data: list[BatchError]
    object: str = "list"


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class BatchUsage(Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = field(default_factory=OutputTokensDetails)


class Batch(Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    object: str = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage = field(default_factory=BatchUsage)


class BatchList(Struct):
    data: list[Batch]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: str = "list"


class CreateBatch(Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; output files are kept until deleted


class InputLine(Struct, forbid_unknown_fields=True):
    """One line of a batch's input file."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]
