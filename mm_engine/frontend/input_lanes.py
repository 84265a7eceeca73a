"""Two worker pools for input work, so that one big request cannot stall small ones.

Tokenizing a long prompt or decoding a large image takes a worker for as long as it takes; with
one pool, two big requests hold every worker and a small caption waits behind them. Each job is
weighed before it is queued (the characters and bytes it carries, counted without copying) and
goes to the light pool when it weighs at most `light_bytes`, else to the heavy pool. Heavy jobs
never take a light worker, so small requests always find one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from PIL import Image

LIGHT_INPUT_BYTES = 128 * 1024


def input_weight(obj: Any, limit: int = 1 << 62) -> int:
    """About how many bytes of text, encoded images and pixels `obj` holds (strings, bytes, PIL
    images, in dicts, lists and tuples); stops counting past `limit`."""
    total, todo = 0, [obj]
    while todo and total <= limit:
        x = todo.pop()
        if isinstance(x, str | bytes | bytearray | memoryview):
            total += len(x)
        elif isinstance(x, Image.Image):
            total += x.width * x.height * 3
        elif hasattr(x, "nbytes"):  # arrays and tensors (a clip's frames)
            total += int(x.nbytes)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, list | tuple):
            todo.extend(x)
    return total


class InputLanes:
    def __init__(self, workers: int, light_bytes: int = LIGHT_INPUT_BYTES) -> None:
        self.light_bytes = light_bytes
        self._heavy = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mm-inputs")
        self._light = concurrent.futures.ThreadPoolExecutor(
            max(1, workers // 2), thread_name_prefix="mm-inputs-light"
        )

    async def run(self, weight: int, fn: Callable[..., Any], *args: Any) -> Any:
        pool = self._light if weight <= self.light_bytes else self._heavy
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def shutdown(self) -> None:
        for pool in (self._heavy, self._light):
            pool.shutdown(wait=False, cancel_futures=True)
