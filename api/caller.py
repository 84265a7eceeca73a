"""Who a request runs for, as the chat and completions handlers see it: a client over HTTP (its
disconnect cancels the work, its sequences count against its cap, it may set `priority` only where
the operator allows) or a line of a batch (background priority, no connection to watch)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from litestar import Request

from mm_engine.api.client_sequences import ClientSequences
from mm_engine.api.limits import check_priority
from mm_engine.api.settings import ServerSettings
from mm_engine.api.streaming import until_disconnect
from mm_engine.outputs import RequestOutput

T = TypeVar("T")
Streams = list[AsyncIterator[RequestOutput]]


class Caller(Protocol):
    def priority(self, requested: int, settings: ServerSettings) -> int: ...

    def hold(self, streams: Streams) -> Streams: ...

    async def run(self, awaitable: Awaitable[T]) -> T: ...


class HttpCaller:
    def __init__(self, request: Request, clients: ClientSequences) -> None:
        self.request, self.clients = request, clients

    def priority(self, requested: int, settings: ServerSettings) -> int:
        return check_priority(requested, settings)

    def hold(self, streams: Streams) -> Streams:
        return self.clients.hold(self.request, streams)

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` unless the client disconnects first (then it is cancelled)."""
        return await until_disconnect(self.request, awaitable)


class BatchCaller:
    """A batch line: the batch's priority (background work, see sched/policy.py). A line's own
    `priority`, where the operator allows one, orders lines within the batch and never goes ahead
    of the batch's."""

    def __init__(self, batch_priority: int) -> None:
        self.batch_priority = batch_priority

    def priority(self, requested: int, settings: ServerSettings) -> int:
        return self.batch_priority + max(0, check_priority(requested, settings))

    def hold(self, streams: Streams) -> Streams:
        return streams

    async def run(self, awaitable: Awaitable[T]) -> T:
        return await awaitable
