"""A multipart/form-data body streamed part by part: the one file part goes to disk as it arrives
(never whole in memory), the small text fields are kept. Litestar's own parser reads the whole
body first, which a file of requests (hundreds of MB of data URLs) must not."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

MAX_HEADER_BYTES = 16 * 1024
MAX_FIELD_BYTES = 4096
MAX_PARTS = 16
OVERHEAD_BYTES = 64 * 1024  # what a body may hold besides the file: boundaries, headers, fields
_PARAM = re.compile(r';\s*([\w*-]+)="?([^";]*)"?')


class MultipartError(ValueError):
    """The body is not the multipart form it says it is, or breaks a limit (the message says which)."""


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # the file part's, as the client named it (never used as a path)
    file_bytes: int = 0


def boundary_of(content_type: str) -> bytes:
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise MultipartError(f"Content-Type must be multipart/form-data, got {media.strip()[:100]!r}")
    found = dict((k.lower(), v) for k, v in _PARAM.findall(";" + params))
    boundary = found.get("boundary", "")
    if not 1 <= len(boundary) <= 70:
        raise MultipartError("the multipart Content-Type has no valid boundary")
    return boundary.encode("latin-1")


async def save_upload(
    chunks: AsyncIterator[bytes], boundary: bytes, file_field: str, dest: Path, max_file_bytes: int
) -> Upload:
    """Parse the body from `chunks`: the part named `file_field` is written to `dest`, at most
    `max_file_bytes`; other parts are text fields. Raises MultipartError."""
    delim = b"--" + boundary
    upload, buf, state = Upload(), b"", "preamble"
    name, sink, value = None, None, bytearray()
    tail = len(delim) + 4  # what may hold the start of a delimiter split over two chunks
    total, parts = 0, 0
    try:
        async for chunk in chunks:
            total += len(chunk)
            if total > max_file_bytes + OVERHEAD_BYTES:  # a preamble or fields without end
                raise MultipartError(f"the body is over the limit of {max_file_bytes} bytes for the file")
            buf += chunk
            while True:
                if state == "preamble":
                    at = buf.find(delim)
                    if at < 0:
                        buf = buf[-tail:]
                        break
                    buf, state = buf[at + len(delim) :], "after"
                elif state == "after":  # just past a delimiter: "--" ends the body, CRLF starts a part
                    if len(buf) < 2:
                        break
                    if buf[:2] == b"--":
                        state = "done"
                        break
                    if buf[:2] != b"\r\n":
                        raise MultipartError("malformed multipart body")
                    buf, state = buf[2:], "headers"
                elif state == "headers":
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > MAX_HEADER_BYTES:
                            raise MultipartError("a multipart part's headers are too long")
                        break
                    name, filename = _disposition(buf[:end])
                    buf, state, parts = buf[end + 4 :], "data", parts + 1
                    if parts > MAX_PARTS:
                        raise MultipartError(f"the form has more than {MAX_PARTS} parts")
                    if name == file_field:
                        if sink is not None:
                            raise MultipartError(f"more than one {file_field!r} part")
                        upload.filename = filename or "upload.jsonl"
                        sink = open(dest, "wb")  # noqa: SIM115 (closed below, whatever happens)
                    value = bytearray()
                else:  # data: up to the next CRLF + delimiter
                    at = buf.find(b"\r\n" + delim)
                    piece = buf[:at] if at >= 0 else buf[: max(0, len(buf) - tail)]
                    if name == file_field:
                        upload.file_bytes += len(piece)
                        if upload.file_bytes > max_file_bytes:
                            raise MultipartError(f"the file is over the limit of {max_file_bytes} bytes")
                        sink.write(piece)
                    elif name is not None:
                        value += piece
                        if len(value) > MAX_FIELD_BYTES:
                            raise MultipartError(f"the form field {name[:50]!r} is too long")
                    if at < 0:
                        buf = buf[len(piece) :]
                        break
                    if name is not None and name != file_field:
                        upload.fields[name] = value.decode("utf-8", "replace")
                    buf, state = buf[at + 2 + len(delim) :], "after"
            if state == "done":
                break
    finally:
        if sink is not None:
            sink.close()
    if state != "done":
        raise MultipartError("the multipart body ended early")
    if upload.filename is None:
        raise MultipartError(f"the form has no {file_field!r} part")
    return upload


def _disposition(head: bytes) -> tuple[str | None, str | None]:
    """The part's form name and filename, from its Content-Disposition header."""
    for line in head.decode("utf-8", "replace").split("\r\n"):
        key, _, rest = line.partition(":")
        if key.strip().lower() == "content-disposition":
            params = dict((k.lower(), v) for k, v in _PARAM.findall(rest))
            return params.get("name"), params.get("filename")
    raise MultipartError("a multipart part has no Content-Disposition")
