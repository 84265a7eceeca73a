"""uvicorn's server with a draining shutdown, for `mm-engine serve` (api/server.py).

The first SIGTERM/SIGINT does not stop the server: the engine starts draining (new requests get
503, running ones get `shutdown_timeout` seconds), and the server exits once that is done. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

logger = logging.getLogger("mm_engine.api")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains the engine before shutting down."""

    def __init__(
        self, config: uvicorn.Config, llm, shutdown_timeout: float,
        before_drain: Callable[[], Awaitable[None]] | None = None,
        on_serving: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """`before_drain`: what stops first (the batch runner: its requests are background work,
        resumed on the next start, not running requests to wait for). `on_serving`: called once the
        server listens with its signal handlers in place (before that, SIGTERM would kill it
        outright instead of draining it), to say it is up."""
        super().__init__(config)
        self.before_drain = before_drain
        self.on_serving = on_serving
        self.llm = llm
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None  # kept referenced until it is done

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_serving is not None:
            self.on_serving()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._draining and self._loop is not None and not self.should_exit:
            self._draining = True
            logger.info("draining: new requests get 503; waiting up to %gs", self.shutdown_timeout)
            self.llm.start_drain()  # at once, so no request slips in before the task runs
            # A signal handler may interrupt the loop anywhere: hand over through the self-pipe.
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        if self.before_drain is not None:
            await self.before_drain()
        await self.llm.drain(self.shutdown_timeout)
        # Let the handlers of aborted requests send their answers before connections close.
        for _ in range(40):
            if not self.llm.num_unfinished:
                break
            await asyncio.sleep(0.05)
        self.should_exit = True
