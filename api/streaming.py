"""Client disconnects and server-sent events.

A handler that waits for the engine cannot notice on its own that its client went away: ASGI
only says so through `receive()`. `until_disconnect` races the work against that message and
cancels the work when the client leaves first; cancelling `AsyncLLM.generate` aborts the request
and frees its blocks. While streaming, Litestar's `Stream` does the same listening itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from litestar import Request
from litestar.response import Stream

from mm_engine.api.errors import APIError, ClientDisconnected, engine_error, error_body, logger
from mm_engine.api.schemas import encoder
from mm_engine.engine.async_types import EngineError
from mm_engine.outputs import RequestOutput

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
# The content type goes in the headers too: Litestar 2 lets the handler's default media type
# (JSON) override a Stream's own.
SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}


async def _wait_for_disconnect(request: Request) -> None:
    # Only called once the body has been read, so every message left is a disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watcher.cancel()
    if work.cancelled() or not work.done():
        with contextlib.suppress(asyncio.CancelledError):
            await work  # let the work's cleanup (the abort) run before we answer
        raise ClientDisconnected()
    return work.result()


async def last_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in gen:
        last = out
    assert last is not None  # generate() yields until an output is finished, or raises
    return last


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Several requests' outputs as they come, each with its stream's index; the first error is
    raised. Closing it closes every stream (which aborts what still runs)."""
    if len(streams) == 1:  # the common case: no task, no queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a generator cannot close while running
        for gen in streams:
            await gen.aclose()


async def all_last(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Every stream's final output, in order; closing early (an error, a disconnect) aborts all."""
    outs: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merged(streams):
        if out.finished:
            outs[i] = out
    return outs


def sse(obj: object) -> bytes:
    return b"data: " + encoder.encode(obj) + b"\n\n"


def error_event(exc: Exception, retry_after: int) -> bytes:
    """An error after the stream started: the status is sent already, so say it in an event."""
    if isinstance(exc, EngineError):
        err = engine_error(exc, retry_after)
    elif isinstance(exc, ValueError):
        err = APIError(400, str(exc), code="invalid_value")
    else:
        logger.error("unexpected error while streaming", exc_info=exc)
        err = APIError(500, "internal server error", code="internal_error")
    return sse(error_body(err))


def sse_response(events: AsyncIterator[bytes]) -> Stream:
    return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS)
