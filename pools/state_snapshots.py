"""Snapshots of hybrid models' recurrent state, for prefix reuse.

A cached KV prefix is of no use to a hybrid model by itself: its linear-attention layers need their
state at the end of that prefix. So at a few chosen points of a prompt (the last block boundary
of each image, the last block boundary before the prompt's last token, and the point just before
that token, which the `n` samples of one prompt share) the forward also writes the state into a
snapshot row of the state pool, keyed by the content hash of the prefix up to there (a block's
hash, or the partial-block hash of a prompt's tail). A later request whose cached prefix ends at
such a point restores it (a row copy at the start of its first forward) and computes the rest.

Rows are a bounded resource, least recently used first out; a snapshot never outlives the cached
block (or live tail) its key names: the block manager drops it when that block is evicted. A
snapshot is written by the step that plans it and offered only once that step is committed.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, rows: range) -> None:
        self.num_rows = len(rows)
        self._free = list(reversed(rows))
        self._published: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recent first
        self._pending: dict[str, list[tuple[bytes, int]]] = {}  # request id -> planned, not committed
        self._planned: set[bytes] = set()  # keys some step is writing
        self._last: dict[str, list[bytes]] = {}  # request id -> keys its last commit published
        self.saved = 0  # snapshots written (planned)
        self.restored = 0  # requests that started from one
        self.evictions = 0

    @property
    def num_used(self) -> int:
        return self.num_rows - len(self._free)

    def has(self, key: bytes) -> bool:
        return key in self._published

    def peek(self, key: bytes) -> int:
        """The row of a published snapshot, now the most recently used."""
        self._published.move_to_end(key)
        return self._published[key]

    def reserve(self, request_id: str, key: bytes) -> int | None:
        """A row for `request_id`'s step to write the state at `key` into; None when the key is
        already kept (or being written) or no row can be had."""
        if key in self._published or key in self._planned:
            return None
        if not self._free:
            if not self._published:
                return None
            old, row = self._published.popitem(last=False)
            self._free.append(row)
            self.evictions += 1
        row = self._free.pop()
        self._pending.setdefault(request_id, []).append((key, row))
        self._planned.add(key)
        self.saved += 1
        return row

    def publish(self, request_id: str, alive) -> bool:
        """Offer the snapshots `request_id`'s committed step wrote whose key `alive(key)` still
        names a cached block or tail; the others' rows go back. Whether any was offered."""
        keys = []
        for key, row in self._pending.pop(request_id, []):
            self._planned.discard(key)
            if alive(key):
                self._published[key] = row
                keys.append(key)
            else:
                self._free.append(row)
        if keys:
            self._last[request_id] = keys
        return bool(keys)

    def unpublish(self, request_id: str) -> None:
        """Withdraw what `request_id`'s last commit offered (its forward failed: never written)."""
        for key in self._last.pop(request_id, []):
            self.drop(key)

    def discard(self, request_id: str) -> None:
        """`request_id` is gone: rows planned for it and not committed go back."""
        for key, row in self._pending.pop(request_id, []):
            self._planned.discard(key)
            self._free.append(row)
        self._last.pop(request_id, None)

    def drop(self, key: bytes) -> None:
        """The block (or tail) `key` names is no longer cached."""
        row = self._published.pop(key, None)
        if row is not None:
            self._free.append(row)

    def report(self) -> dict[str, int]:
        return {
            "snapshot_rows": self.num_rows,
            "snapshots": len(self._published),
            "snapshots_saved": self.saved,
            "snapshots_restored": self.restored,
            "snapshot_evictions": self.evictions,
        }
