"""The lines of one input file run through the same handlers as the HTTP routes (chat or
completions), as background work, each answer appended as it comes.

`InFlight` caps the sequences the batch API has in the engine at once (over all batches): a batch
fills idle capacity without filling the waiting queue that interactive requests need. A line the
engine cannot take now (queue full, draining, engine restarting) waits and is tried again; one it
refuses (a bad image, a prompt too long) gets its status and error body, as an HTTP client would.
Cancelling `run_lines` aborts the requests in flight: their lines stay unanswered, so a resumed run
does them again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable

import msgspec

from mm_engine.api.caller import BatchCaller
from mm_engine.api.context import ServerContext
from mm_engine.api.errors import APIError, engine_error, error_body
from mm_engine.api.openai_schemas import ChatCompletionRequest
from mm_engine.api.routes_chat import chat_completion
from mm_engine.api.routes_completions import completion
from mm_engine.batch.lines import Line
from mm_engine.batch.results import ResultFile, answered, refused
from mm_engine.engine.async_types import EngineError

logger = logging.getLogger("mm_engine.batch")
RETRY_S = 0.5  # how long a line the engine cannot take now waits before it is tried again


class InFlight:
    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> int:
        n = min(n, self.cap)  # a line wider than the cap runs alone
        async with self._changed:
            await self._changed.wait_for(lambda: self.used + n <= self.cap)
            self.used += n
        return n

    async def give(self, n: int) -> None:
        async with self._changed:
            self.used -= n
            self._changed.notify_all()


def sequences_of(body: msgspec.Struct) -> int:
    """How many sequences a request puts in the engine (prompts x n)."""
    prompts = 1
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = len(prompt)
    return prompts * body.n


def report_refused(lines: Iterable[Line], out: ResultFile, stop: threading.Event | None = None) -> int:
    """Write each line that cannot run (and has no entry yet); the number of lines in all. `stop`:
    set from another thread (the batch was cancelled), the pass ends at the next line."""
    total = 0
    for line in lines:
        if stop is not None and stop.is_set():
            break
        total += 1
        if line.error is not None and line.number not in out.refused_lines:
            out.append(refused(line.custom_id, line.code, line.error, line.number))
    return total


async def run_lines(
    ctx: ServerContext, lines: Iterable[Line], ok: ResultFile, failed: ResultFile, priority: int,
    in_flight: InFlight,
) -> None:  # fmt: skip
    """Run every good line that neither file has answered; returns when all have their answer."""
    caller = BatchCaller(priority)
    tasks: set[asyncio.Task] = set()

    async def one(line: Line, held: int) -> None:
        try:
            status, body = await _answer(ctx, line, caller)
            (ok if status == 200 else failed).append(answered(line.custom_id, status, body))
        finally:
            await in_flight.give(held)

    try:
        for line in lines:
            if line.error is not None or line.custom_id in ok.done or line.custom_id in failed.done:
                continue
            held = await in_flight.take(sequences_of(line.body))
            task = asyncio.create_task(one(line, held))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*list(tasks), return_exceptions=True)


async def _answer(ctx: ServerContext, line: Line, caller: BatchCaller) -> tuple[int, object]:
    handler = chat_completion if isinstance(line.body, ChatCompletionRequest) else completion
    while True:
        try:
            return 200, msgspec.to_builtins(await handler(ctx, line.body, caller))
        except EngineError as exc:
            err = engine_error(exc, ctx.settings.retry_after_seconds)
        except APIError as exc:
            err = exc
        except Exception:
            logger.exception("batch line %s (custom_id %r) failed", line.number, line.custom_id)
            err = APIError(500, "internal server error", code="internal_error")
        if err.status not in (429, 503):
            return err.status, msgspec.to_builtins(error_body(err))
        await asyncio.sleep(RETRY_S)  # not now: the queue is full, or the engine is restarting
