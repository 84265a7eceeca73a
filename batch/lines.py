"""A batch's input file read line by line and checked, never whole in memory.

Each non-blank line must be a JSON object `{"custom_id", "method": "POST", "url", "body"}` whose
url is the batch's endpoint, whose custom_id no earlier line used, and whose body is a valid
request for that endpoint (checked as strictly as the HTTP routes check theirs) that does not ask
to stream. A bad line is reported with its number (from 1); a file with no good line at all, or that
is not UTF-8 JSONL, fails the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from mm_engine.api.completions_schemas import CompletionRequest
from mm_engine.api.openai_schemas import ChatCompletionRequest
from mm_engine.batch.schemas import InputLine

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
MAX_CUSTOM_ID = 512


@dataclass(slots=True)
class Line:
    number: int  # from 1
    custom_id: str | None  # None where the line did not say (or not as a string)
    body: msgspec.Struct | None = None  # the request, when the line is good
    error: str | None = None  # what is wrong with it, when it is not
    code: str = "invalid_request"


class NotJSONL(ValueError):
    """The file is not JSON lines at all (its batch fails)."""


def read_lines(path: Path, endpoint: str | None, max_line_bytes: int) -> Iterator[Line]:
    """Every non-blank line of the file, checked (`endpoint` None: each line's url may be either
    endpoint, as `run-batch` takes them). Raises NotJSONL when the file is not UTF-8 JSON lines (no
    line at all decodes as a JSON object)."""
    seen: set[str] = set()
    good_json = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(_bounded_lines(f, max_line_bytes), start=1):
            if raw is None:
                yield Line(
                    number, None, error=f"line {number} is over {max_line_bytes} bytes", code="line_too_long"
                )
                continue
            if not raw.strip():
                continue
            try:
                value = msgspec.json.decode(raw)
            except msgspec.DecodeError as exc:
                yield Line(
                    number, None, error=f"line {number} is not valid JSON: {exc}", code="invalid_json_line"
                )
                continue
            if not isinstance(value, dict):
                yield Line(
                    number, None, error=f"line {number} is not a JSON object", code="invalid_json_line"
                )
                continue
            good_json += 1
            line = _check(number, value, endpoint, seen)
            if line.error is None:
                seen.add(line.custom_id)
            yield line
    if not good_json:
        raise NotJSONL("the input file has no JSON object lines: it must be JSONL, one request per line")


def _check(number: int, value: dict, endpoint: str | None, seen: set[str]) -> Line:
    cid = value.get("custom_id")
    cid = cid if isinstance(cid, str) else None
    try:
        line = msgspec.convert(value, InputLine, strict=True)
    except msgspec.ValidationError as exc:
        return Line(number, cid, error=f"line {number}: {exc}")
    if not 1 <= len(line.custom_id) <= MAX_CUSTOM_ID:
        return Line(number, cid, error=f"line {number}: custom_id must be 1 to {MAX_CUSTOM_ID} characters")
    if line.custom_id in seen:
        return Line(number, cid, error=f"line {number}: custom_id {cid[:100]!r} is used by an earlier line",
                    code="duplicate_custom_id")  # fmt: skip
    if line.method != "POST":
        return Line(number, cid, error=f"line {number}: method must be POST, got {line.method[:20]!r}")
    if line.url != endpoint and (endpoint is not None or line.url not in BODIES):
        allowed = repr(endpoint) if endpoint else " or ".join(BODIES)
        message = f"line {number}: url {line.url[:100]!r} is not the batch's endpoint {allowed}"
        return Line(number, cid, error=message, code="mismatched_endpoint")
    try:
        body = msgspec.convert(line.body, BODIES[line.url], strict=True)
    except msgspec.ValidationError as exc:
        return Line(number, cid, error=f"line {number}: body: {exc}")
    if body.stream:
        return Line(number, cid, error=f"line {number}: body: stream is not supported in a batch")
    return Line(number, cid, body=body)


def _bounded_lines(f, limit: int) -> Iterator[bytes | None]:
    """The file's lines (without their newline), or None for one longer than `limit` bytes
    (skipped without being held whole)."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of the long line
                raw = f.readline(1 << 20)
            yield None
            continue
        yield raw.rstrip(b"\r\n")
