"""A batch's results, appended line by line as requests finish, and read back on a restart.

Each line is written whole with one `write` to a file opened for appending, so a stopped process
leaves at most one partial last line, which `open` cuts off. What a results file says is done (its
custom_ids, counts and token usage) is read from the file itself: the file is the only record, so
a restarted batch runs exactly the requests that have no line yet.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from mm_engine.batch.schemas import BatchUsage

_encoder = msgspec.json.Encoder()


@dataclass
class ResultFile:
    path: Path
    done: set[str] = field(default_factory=set)  # custom_ids answered (ok or failed)
    refused_lines: set[int] = field(default_factory=set)  # line numbers reported as not runnable
    lines: int = 0
    failed: int = 0  # lines that could not run or whose answer is an error (status >= 400)
    usage: BatchUsage = field(default_factory=BatchUsage)
    _fd: int = -1

    @classmethod
    def open(cls, path: Path) -> ResultFile:
        out = cls(Path(path))
        if out.path.exists():
            out._read_back()
        out._fd = os.open(out.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return out

    def _read_back(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a partial last line: the process stopped while writing it
            os.truncate(self.path, end)
        for raw in data[:end].splitlines():
            try:
                entry = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                continue
            if isinstance(entry, dict):
                self._note(entry)

    def _note(self, entry: dict) -> None:
        self.lines += 1
        response = entry.get("response")
        self.failed += response is None or response.get("status_code", 200) >= 400
        if response is not None:
            self.done.add(entry["custom_id"])
        elif isinstance(entry.get("error"), dict) and isinstance(entry["error"].get("line"), int):
            self.refused_lines.add(entry["error"]["line"])
        usage = ((entry.get("response") or {}).get("body") or {}).get("usage")
        if isinstance(usage, dict):
            self.usage.input_tokens += usage.get("prompt_tokens", 0)
            self.usage.output_tokens += usage.get("completion_tokens", 0)
            self.usage.total_tokens += usage.get("total_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.usage.input_tokens_details.cached_tokens += cached

    def append(self, entry: dict[str, Any]) -> None:
        # No fsync here: a stopped or killed process loses nothing the OS has; syncing on the
        # event loop would stall interactive streams behind the disk (sync() at the end).
        os.write(self._fd, _encoder.encode(entry) + b"\n")
        self._note(entry)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1


def answered(custom_id: str, status: int, body: Any) -> dict[str, Any]:
    """A request's line: OpenAI's shape, the handler's status and body (an error body when >= 400)."""
    line_id = "batch_req_" + secrets.token_hex(16)
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or line_id, "body": body},
        "error": None,
    }


def refused(custom_id: str | None, code: str, message: str, line: int) -> dict[str, Any]:
    """A line that never ran (it did not pass the checks), with its line number."""
    return {
        "id": "batch_req_" + secrets.token_hex(16),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": line},
    }
