"""Files under `<batch dir>/files`: `<id>.data` holds the bytes, `<id>.json` the FileObject. A file
is visible once its JSON exists (an upload is written first, then described; a batch's output grows
in place and is described when the batch ends). Ids are random (128 bits) and checked against
their pattern before any path is built from them: no path comes from a client."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path

import msgspec

from mm_engine.batch.schemas import FileObject

_ID = re.compile(r"file-[0-9a-f]{32}")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(16)


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Write `data` to `path` so that a reader (or a restart) sees the old or the new, never half;
    `durable`: on disk before this returns (not for progress counts rewritten every second)."""
    tmp = path.with_name(path.name + f".{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "files"
        self.root.mkdir(parents=True, exist_ok=True)

    def data_path(self, file_id: str) -> Path:
        if not _ID.fullmatch(file_id):
            raise LookupError(file_id)
        return self.root / f"{file_id}.data"

    def _meta_path(self, file_id: str) -> Path:
        return self.data_path(file_id).with_suffix(".json")

    def upload_path(self) -> Path:
        """Where an upload streams to before it is published under an id."""
        return self.root / f"upload-{secrets.token_hex(8)}.part"

    def publish(self, file_id: str, filename: str, purpose: str, source: Path | None = None) -> FileObject:
        """Describe a file (moving `source` into place first, if given): from now on it is listed."""
        data = self.data_path(file_id)
        if source is not None:
            os.replace(source, data)
        obj = FileObject(
            id=file_id,
            bytes=data.stat().st_size,
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        write_atomic(self._meta_path(file_id), msgspec.json.encode(obj))
        return obj

    def get(self, file_id: str) -> FileObject:
        try:
            return msgspec.json.decode(self._meta_path(file_id).read_bytes(), type=FileObject)
        except (FileNotFoundError, LookupError):
            raise LookupError(file_id) from None

    def list(self, purpose: str | None = None) -> list[FileObject]:
        """Every visible file, oldest first."""
        out = []
        for meta in self.root.glob("file-*.json"):
            try:
                obj = msgspec.json.decode(meta.read_bytes(), type=FileObject)
            except (FileNotFoundError, msgspec.DecodeError):
                continue  # deleted meanwhile
            if purpose is None or obj.purpose == purpose:
                out.append(obj)
        out.sort(key=lambda f: (f.created_at, f.id))
        return out

    def delete(self, file_id: str) -> None:
        meta = self._meta_path(file_id)
        if not meta.exists():
            raise LookupError(file_id)
        meta.unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        """Bytes held by files and uploads in progress (against the store's cap)."""
        total = 0
        for path in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def clean_partial_uploads(self, older_than_s: float = 3600.0) -> None:
        """Uploads a stopped process left unfinished (old enough not to be another server's, live)."""
        for path in self.root.glob("upload-*.part"):
            try:
                if time.time() - path.stat().st_mtime > older_than_s:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
