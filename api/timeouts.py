"""Read timeouts for HTTP/1.1 connections: uvicorn's h11 protocol, with a limit on how long a
client may take to send a request's head and on how long it may go silent while sending a body.

uvicorn times out only idle keep-alive connections: a client that opens a connection and sends
nothing, or half a request head, or a body that stops part-way, holds the connection (and, for
the body, the handler waiting on it) forever. Here:
- `header_timeout`: seconds from the connection's start, or from the end of its previous response,
  until the request head is complete;
- `body_timeout`: seconds the client may go without sending any body bytes while the body is due
  (not counted while the server itself has paused reading).
On expiry the client gets `408 Request Timeout` (nothing, if it never sent a byte) and the
connection is closed; a handler waiting on the body sees a disconnect.

And a write timeout: `send_timeout`, seconds the response may stay stuck in a full send buffer
(the client stopped reading) before the connection is dropped, so that a streamed response whose
client never reads is aborted instead of held, with its output buffered, forever.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 16\r\n\r\nrequest timeout\n"
)


class TimedH11Protocol(H11Protocol):
    header_timeout = 10.0
    body_timeout = 30.0
    send_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._got_bytes = False  # of the request now due
        super().connection_made(transport)
        self._arm(self.header_timeout)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # the head is in
            self._arm(self.body_timeout if cycle.more_body else None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._got_bytes = False
            self._arm(self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        self._unstuck()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._stuck)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstuck()

    def _unstuck(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _stuck(self) -> None:
        """The client has not taken a byte for `send_timeout` s: drop the connection (abort: a
        close would wait for the buffer to drain). The handler then sees a disconnect."""
        self._send_timer = None
        self.transport.abort()

    def _arm(self, seconds: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if seconds is None else self.loop.call_later(seconds, self._expired, seconds)

    def _expired(self, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server stopped reading: not the client's delay
            self._arm(seconds)
            return
        cycle = self.cycle
        if self._got_bytes and (cycle is None or cycle.response_complete or not cycle.response_started):
            self.transport.write(_408)
        self.transport.close()


def timed_h11_protocol(
    header_timeout: float, body_timeout: float, send_timeout: float = 30.0
) -> type[TimedH11Protocol]:
    """The protocol class to give `uvicorn.Config(http=...)`."""
    return type(
        "TimedH11Protocol",
        (TimedH11Protocol,),
        {"header_timeout": header_timeout, "body_timeout": body_timeout, "send_timeout": send_timeout},
    )
