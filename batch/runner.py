"""BatchRunner: the API server's service that takes each batch from `validating` to its end.

It owns every batch it runs (only it writes their state; one runner per folder, held by a lock
file, so two servers on one folder never run a batch twice), resumes on start what a stopped process
left in `validating`, `in_progress` or `finalizing`, and looks every `poll_s` (or when woken) for
new batches, cancel marks and expiry. Stopping it (shutdown, drain) cancels the lines in flight,
which stay unanswered, and leaves each batch's state as it was, to resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mm_engine.api.context import ServerContext
from mm_engine.batch.files import FileStore
from mm_engine.batch.job import InFlight, report_refused, run_lines
from mm_engine.batch.lines import NotJSONL, read_lines
from mm_engine.batch.results import ResultFile
from mm_engine.batch.schemas import ACTIVE, BatchError, BatchErrors
from mm_engine.batch.store import BatchState, BatchStore

logger = logging.getLogger("mm_engine.batch")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class BatchRunner:
    def __init__(
        self, ctx: ServerContext, root: Path, *, priority: int, max_in_flight: int, max_line_bytes: int,
        poll_s: float = 1.0, clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.ctx, self.priority, self.max_line_bytes = ctx, priority, max_line_bytes
        self.files, self.store = FileStore(root), BatchStore(root)
        self.poll_s, self.clock = poll_s, clock
        self.in_flight = InFlight(max_in_flight)
        self._batches: dict[str, asyncio.Task] = {}  # batch id -> its task
        self._work: dict[str, asyncio.Task] = {}  # batch id -> the task running its lines
        self._results: dict[str, tuple[ResultFile, ResultFile]] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Cancel everything in flight; each batch keeps its state and resumes on the next start."""
        tasks = [t for t in (self._loop_task, *self._batches.values()) if t is not None]
        self._loop_task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def uses_input(self, file_id: str) -> bool:
        """Whether a batch still to finish reads this file."""
        return any(s.batch.input_file_id == file_id and s.batch.status in ACTIVE for s in self.store.all())

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        lock = os.open(self.store.root.parent / "runner.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while not _try_lock(lock):  # another server runs this folder's batches
                logger.warning("another server runs the batches in this folder; waiting to take over")
                await asyncio.sleep(max(self.poll_s, 5.0))
            self.files.clean_partial_uploads()
            await self._look_every_poll()
        finally:
            os.close(lock)  # (the lock goes with the descriptor)

    async def _look_every_poll(self) -> None:
        ended: set[str] = set()  # batches seen finished: not read again every poll
        while True:
            for state in self.store.all(skip=ended):
                if state.batch.status in ACTIVE:
                    self._look_at(state)
                else:
                    ended.add(state.batch.id)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    def _look_at(self, state: BatchState) -> None:
        b = state.batch
        if b.id not in self._batches:
            task = asyncio.create_task(self._run(state))
            self._batches[b.id] = task
            task.add_done_callback(lambda _, i=b.id: self._batches.pop(i, None))
            return
        work = self._work.get(b.id)
        if work is None or work.done():
            return
        if self.store.cancel_time(b.id) is not None:
            self._end(b.id, "cancelled")
        elif self.clock() >= b.expires_at:
            self._end(b.id, "expired")
        elif b.id in self._results:  # progress, for clients polling from any API server
            out, err = self._results[b.id]
            counts = b.request_counts
            if (counts.completed, counts.failed) != (out.lines, err.lines):
                counts.completed, counts.failed = out.lines, err.lines
                self.store.save(state, durable=False)

    def _end(self, batch_id: str, status: str) -> None:
        state = self.store.load(batch_id)
        if state.ending is None:
            state.ending = status
            self.store.save(state)
        self._work[batch_id].cancel()

    async def _run(self, state: BatchState) -> None:
        b = state.batch
        out = ResultFile.open(self.files.data_path(state.output_file))
        err = ResultFile.open(self.files.data_path(state.error_file))
        self._results[b.id] = (out, err)
        try:
            if state.ending is None and b.status != "finalizing":
                if self.store.cancel_time(b.id) is not None:
                    state.ending = "cancelled"
                elif self.clock() >= b.expires_at:
                    state.ending = "expired"
            if state.ending is None and b.status != "finalizing":
                work = asyncio.create_task(self._run_lines(state, out, err))
                self._work[b.id] = work
                try:
                    await work
                    state.ending = "completed"
                except asyncio.CancelledError:
                    state = self.store.load(b.id)  # _end wrote why, if it was a cancel or expiry
                    if state.ending is None or not work.cancelled():
                        raise  # the runner is stopping: the batch resumes on the next start
                except (NotJSONL, LookupError) as exc:
                    gone = isinstance(exc, LookupError)
                    self._fail(state, "invalid_file", "the input file no longer exists" if gone else str(exc))
                    return
                except Exception:  # a bug: the batch fails rather than being retried every poll
                    logger.exception("batch %s could not run", b.id)
                    self._fail(state, "internal_error", "the batch could not run (the server log says why)")
                    return
            self._finalize(state, out, err)
        finally:
            self._work.pop(b.id, None)
            self._results.pop(b.id, None)
            out.close()
            err.close()

    async def _run_lines(self, state: BatchState, out: ResultFile, err: ResultFile) -> None:
        b = state.batch
        path = self.files.data_path(b.input_file_id)
        if not path.exists():
            raise LookupError(b.input_file_id)
        if b.status == "validating":  # a pass over the file, off the event loop
            lines = read_lines(path, b.endpoint, self.max_line_bytes)
            stop = threading.Event()  # a cancelled batch's thread stops too, not at the file's end
            try:
                b.request_counts.total = await asyncio.to_thread(report_refused, lines, err, stop)
            except asyncio.CancelledError:
                stop.set()
                raise
            b.request_counts.failed = err.lines
            b.status, b.in_progress_at = "in_progress", int(self.clock())
            self.store.save(state)
        lines = read_lines(path, b.endpoint, self.max_line_bytes)
        await run_lines(self.ctx, lines, out, err, self.priority, self.in_flight)

    def _fail(self, state: BatchState, code: str, message: str) -> None:
        b = state.batch
        b.status, b.failed_at = "failed", int(self.clock())
        b.errors = BatchErrors([BatchError(code, message)])
        self.store.save(state)
        for file_id in (state.output_file, state.error_file):
            self.files.data_path(file_id).unlink(missing_ok=True)

    def _finalize(self, state: BatchState, out: ResultFile, err: ResultFile) -> None:
        b = state.batch
        now = int(self.clock())
        if b.status != "finalizing":
            b.status, b.finalizing_at = "finalizing", now
            self.store.save(state)
        out.sync()
        err.sync()
        b.request_counts.completed, b.request_counts.failed = out.lines, err.lines
        for file_id, result, kind in ((state.output_file, out, "output"), (state.error_file, err, "error")):
            if result.lines:
                self.files.publish(file_id, f"{b.id}_{kind}.jsonl", "batch_output")
                setattr(b, f"{kind}_file_id", file_id)
            else:
                self.files.data_path(file_id).unlink(missing_ok=True)
        b.usage = out.usage
        b.status = state.ending or "completed"
        setattr(b, f"{b.status}_at", now)
        if b.status == "cancelled":
            b.cancelling_at = self.store.cancel_time(b.id) or now
        self.store.save(state)
        logger.info("batch %s %s: %d answered, %d failed", b.id, b.status, out.lines, err.lines)
