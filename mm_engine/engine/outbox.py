"""One thread that sends the frontend's messages to its core processes, in the order they were put.

Building an `Add` copies the request's new images' pixels into the message, and encoding it copies
them again; both are done here rather than on the event loop that took the request, and outside
the lock the reader threads need for detokenizing. Everything a frontend sends to its cores goes
through one outbox, so each core sees messages in the order they were decided (an `Add` before
its `Abort`; pixels before a later `Add` that names their hash alone).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("mm_engine.async_llm")

_STOP = object()


class Outbox:
    def __init__(self, deliver: Callable[[Any], None], name: str = "mm-outbox") -> None:
        """`deliver(item)` runs on the outbox thread for each item, in order; what it raises is
        logged and the next item goes on."""
        self._deliver = deliver
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        self._items.put(item)

    def close(self) -> None:
        """Send what was put before, then stop the thread."""
        self._items.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._items.get()) is not _STOP:
            try:
                self._deliver(item)
            except Exception:  # a core that died meanwhile: its reader thread reports that
                logger.debug("a message to an engine core was not sent", exc_info=True)
