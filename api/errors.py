"""Every error leaves the server in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Messages are for the client: they never carry a server path, a memory address or a traceback
(those go to the log). Anything unexpected is a 500 with a fixed message.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from jinja2 import TemplateError
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from mm_engine.api.schemas import ErrorDetail, ErrorResponse
from mm_engine.engine.async_types import (
    EngineDeadError,
    EngineDrainingError,
    EngineError,
    EngineOverloadedError,
)

logger = logging.getLogger("mm_engine.api")

_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}
_CODES = {
    400: "invalid_value",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "queue_full",
    503: "service_unavailable",
}
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{4,}\b")
_PATH = re.compile(r"(?<![\w.:/])(?:[A-Za-z]:)?[/\\](?:[\w.\- ]+[/\\])+[\w.\-]*")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODES.get(status)
        self.retry_after = retry_after


class ClientDisconnected(Exception):
    """The client went away before the response was ready; its request was aborted."""


def sanitize(message: str, limit: int = 500) -> str:
    """Strip what could describe the server (paths, addresses) from a message meant for clients."""
    message = _ADDRESS.sub("0x?", message)
    message = _PATH.sub("<path>", message)
    return message if len(message) <= limit else message[:limit] + "..."


def error_body(err: APIError) -> ErrorResponse:
    kind = _TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return ErrorResponse(ErrorDetail(sanitize(err.message), kind, err.param, err.code))


def error_response(err: APIError) -> Response[ErrorResponse]:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return Response(error_body(err), status_code=err.status, headers=headers)


def engine_error(exc: EngineError, retry_after: int) -> APIError:
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), retry_after=retry_after)
    if isinstance(exc, EngineDrainingError):
        return APIError(503, str(exc), code="draining", retry_after=retry_after)
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    return APIError(500, str(exc), code="engine_error")  # our own fixed messages, no details


@contextlib.contextmanager
def client_errors(param: str | None) -> Iterator[None]:
    """Turn a ValueError of the engine (bad prompt, bad image, too long) into a 400 naming `param`
    (or the field the message names: the engine checks token ids and logit_bias on admission)."""
    try:
        yield
    except (ValueError, TemplateError) as exc:
        message = str(exc) or "invalid request"
        named = next((p for prefix, p in _NAMED_BY if message.startswith(prefix)), param)
        raise APIError(400, message, param=named, code="invalid_value") from None


_NAMED_BY = (
    ("logit_bias", "logit_bias"),
    ("allowed_token_ids", "allowed_token_ids"),
    ("bad_words", "bad_words"),
    ("prompt token", "prompt"),
)


# ---- Litestar exception handlers -----------------------------------------------------------------


def _on_api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc)


def _on_engine_error(request: Request, exc: EngineError) -> Response:
    retry = request.app.state.ctx.settings.retry_after_seconds
    return error_response(engine_error(exc, retry))


def _on_validation(request: Request, exc: ValidationException) -> Response:
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    detail = first.get("message") or exc.detail
    key = first.get("key")
    path = key if key and key != "data" else ""  # "data" is Litestar's name for the whole body
    # msgspec names the spot as "... - at `$.messages[0].content`"; that is the param.
    match = re.search(r" - at `\$\.?(.*)`$", detail)
    if match:
        detail, path = detail[: match.start()], match.group(1)
    unknown = re.search(r"^Object contains unknown field `([^`]+)`", detail)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        message = f"'{path[:200]}' is not a parameter this server knows (it would otherwise be ignored)"
        return error_response(APIError(400, message, param=path[:200], code="unknown_parameter"))
    missing = re.search(r"missing required field `([^`]+)`", detail)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return error_response(APIError(400, f"'{path}' is required", param=path))
    if detail.startswith("Validation failed for"):
        detail = "the request body is not valid"
    if path == "" and detail == "'data'":  # Litestar's way of saying there is no body at all
        return error_response(APIError(400, "the request body is empty; send a JSON object"))
    if detail.startswith("Unsupported type: <class 'str'>"):  # a text field where a file goes
        detail = "expected a file part (with a filename), got a text field"
    message = f"invalid value for '{path}': {detail}" if path else detail
    return error_response(APIError(400, message, param=path or None))


def _on_http(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if exc.detail == "client disconnected prematurely":  # Litestar's words, mid-upload: not ours
        logger.debug(
            "client disconnected while sending %s (request %s)", request.url.path, _request_id(request)
        )
        return error_response(APIError(400, "client disconnected", code="client_disconnected"))
    if status >= 500:
        logger.error(
            "internal error on %s (request %s)", request.url.path, _request_id(request), exc_info=exc
        )
        return error_response(APIError(500, "internal server error", code="internal_error"))
    if status == 404:
        message = "no such route"
    elif status == 413:
        limit = request.app.state.ctx.settings.max_body_bytes
        message = f"the request body is larger than the limit of {limit} bytes"
    elif exc.detail == "Request Entity Too Large":  # Litestar 2's answer to too many form parts
        message = "the form has too many parts"
    elif exc.detail == "Input data was truncated":  # msgspec, on blank or cut-off JSON
        message = "the JSON body is blank or incomplete"
    else:
        message = exc.detail or "bad request"
    return error_response(APIError(status, message))


def _on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
    return error_response(APIError(400, "client disconnected", code="client_disconnected"))


# Raised while Litestar parses a body it cannot make sense of: the client's mistake, not ours.
_BODY_ERRORS = {
    UnicodeDecodeError: "a form field is not valid UTF-8 (an image goes in a file part, with a filename)",
    LookupError: "a form field names an unknown charset",
    RecursionError: "the JSON body is nested too deeply",
}


def _raised_parsing_the_body(exc: Exception) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/litestar/" in tb.tb_frame.f_code.co_filename


def _on_unexpected(request: Request, exc: Exception) -> Response:
    for kind, message in _BODY_ERRORS.items():
        if isinstance(exc, kind) and _raised_parsing_the_body(exc):
            return error_response(APIError(400, message, code="invalid_body"))
    logger.error("unexpected error on %s (request %s)", request.url.path, _request_id(request), exc_info=exc)
    return error_response(APIError(500, "internal server error", code="internal_error"))


EXCEPTION_HANDLERS = {
    APIError: _on_api_error,
    EngineError: _on_engine_error,
    ValidationException: _on_validation,
    HTTPException: _on_http,
    ClientDisconnected: _on_disconnect,
    Exception: _on_unexpected,
}


def _request_id(request) -> str:
    """The x-request-id the middleware (request_id.py) gave this request."""
    return request.scope.get("state", {}).get("request_id", "-")
