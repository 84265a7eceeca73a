"""Sequences in flight per client, capped (`--max-sequences-per-client`): one client's many requests
(each up to `--max-sequences-per-request`) cannot fill the engine's queue for everyone else.

A client is its network address (behind a proxy every client shares the proxy's: raise the cap, or
0 turns it off). Each of a request's sequences holds one unit until its stream ends or is closed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

from litestar import Request

from mm_engine.api.errors import APIError
from mm_engine.outputs import RequestOutput


class ClientSequences:
    def __init__(self, cap: int, retry_after: int = 1) -> None:
        """`cap`: sequences in flight per client (0: no cap)."""
        self.cap = cap
        self.retry_after = retry_after
        self.in_flight: Counter[str] = Counter()

    @staticmethod
    def client_of(request: Request) -> str:
        return request.client.host if request.client else "unknown"

    def hold(self, request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[_Held]:
        """The streams (not started yet: dropping one does nothing), each holding one of its
        client's units until it ends or is closed; a 429 when they would pass the client's cap."""
        client = self.client_of(request)
        if self.cap and self.in_flight[client] + len(streams) > self.cap:
            message = (
                f"this client has {self.in_flight[client]} sequences in flight; {len(streams)} more "
                f"would pass max_sequences_per_client={self.cap}"
            )
            raise APIError(429, message, code="too_many_requests", retry_after=self.retry_after)
        self.in_flight[client] += len(streams)
        return [_Held(self, client, s) for s in streams]

    def _release(self, client: str) -> None:
        self.in_flight[client] -= 1
        if self.in_flight[client] <= 0:
            del self.in_flight[client]


class _Held:
    """An output stream that gives its unit back once: at its end, on an error, when closed, or
    (a stream dropped unstarted) when collected."""

    def __init__(self, owner: ClientSequences, client: str, stream: AsyncIterator[RequestOutput]) -> None:
        self._owner, self._client, self._stream = owner, client, stream
        self._held = True

    def __aiter__(self) -> _Held:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await anext(self._stream)
        except BaseException:  # the end (StopAsyncIteration), an error, a cancellation
            self._give_back()
            raise

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._give_back()

    def _give_back(self) -> None:
        if self._held:
            self._held = False
            self._owner._release(self._client)

    def __del__(self) -> None:
        self._give_back()
