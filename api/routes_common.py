"""Pieces every route uses: the content-type and strict-body checks and the documented error responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from litestar import Request
from litestar.exceptions import SerializationException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

from mm_engine.api.errors import APIError
from mm_engine.api.schemas import ErrorResponse

_DESCRIPTIONS = {
    400: "Invalid request (`param` names the field)",
    404: "Unknown model",
    413: "Body over the size limit",
    415: "Wrong content type",
    429: "Waiting queue full (see Retry-After)",
    500: "Unexpected server error",
    503: "Draining or engine not running (see Retry-After)",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    return {
        status: ResponseSpec(data_container=ErrorResponse, description=_DESCRIPTIONS[status])
        for status in statuses or _DESCRIPTIONS
    }


def require_content_type(expected: str) -> Callable[[Request], Awaitable[None]]:
    """A `before_request` hook: it runs before Litestar parses the body."""

    async def check(request: Request) -> None:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != expected:
            raise APIError(415, f"Content-Type must be {expected}, got {media[:100] or 'none'!r}")

    return check


def json_body(model: type[msgspec.Struct]) -> Callable[[Request], Awaitable[None]]:
    """A `before_request` hook for a JSON route: the Content-Type, then the body checked against
    `model` strictly (`"10"` is not an integer, `1.0` not a count). Litestar's own conversion of
    the body, after this, is lenient; the body is parsed once (Litestar caches it)."""
    content_type = require_content_type("application/json")

    async def check(request: Request) -> None:
        await content_type(request)
        try:
            body = await request.json()
        except SerializationException:
            return  # not JSON at all: Litestar says so as it parses the body
        if body is None:
            return  # no body: the same
        try:
            msgspec.convert(body, model, strict=True)
        except msgspec.ValidationError as exc:
            raise ValidationException(detail=str(exc)) from None

    return check
