"""Each batch's state under `<batch dir>/batches`: `<id>.json` (the Batch object and the ids of its
output and error files), rewritten whole and atomically by the one runner that owns the batch, and
`<id>.cancel`, the mark a cancel request leaves (any API server may take one; only the runner
writes the state, so two processes never write one file)."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import msgspec

from mm_engine.batch.files import write_atomic
from mm_engine.batch.schemas import ACTIVE, Batch

_ID = re.compile(r"batch_[0-9a-f]{32}")


class BatchState(msgspec.Struct):
    batch: Batch
    output_file: str  # file ids reserved when the batch is made; published when it ends
    error_file: str
    ending: str | None = None  # the status it finalizes into, once decided (a restart keeps it)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "batches"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, batch_id: str, suffix: str) -> Path:
        if not _ID.fullmatch(batch_id):
            raise LookupError(batch_id)
        return self.root / f"{batch_id}{suffix}"

    def save(self, state: BatchState, durable: bool = True) -> None:
        write_atomic(self._path(state.batch.id, ".json"), msgspec.json.encode(state), durable)

    def load(self, batch_id: str) -> BatchState:
        try:
            return msgspec.json.decode(self._path(batch_id, ".json").read_bytes(), type=BatchState)
        except FileNotFoundError:
            raise LookupError(batch_id) from None

    def view(self, batch_id: str) -> Batch:
        """The batch as a client sees it: "cancelling" from the moment a cancel was asked for."""
        batch = self.load(batch_id).batch
        marked = self.cancel_time(batch_id)
        if marked is not None and batch.status in ACTIVE:
            batch.status, batch.cancelling_at = "cancelling", marked
        return batch

    def all(self, skip: set[str] = frozenset()) -> list[BatchState]:
        """Every batch (but those whose ids are in `skip`), oldest first."""
        out = []
        for path in self.root.glob("batch_*.json"):
            if path.stem in skip:
                continue
            try:
                out.append(msgspec.json.decode(path.read_bytes(), type=BatchState))
            except (FileNotFoundError, msgspec.DecodeError):
                continue
        out.sort(key=lambda s: (s.batch.created_at, s.batch.id))
        return out

    def request_cancel(self, batch_id: str) -> None:
        path = self._path(batch_id, ".cancel")
        if not path.exists():
            write_atomic(path, str(int(time.time())).encode())

    def cancel_time(self, batch_id: str) -> int | None:
        try:
            return int(self._path(batch_id, ".cancel").read_bytes() or 0)
        except (FileNotFoundError, ValueError):
            return None
