"""The engine cores behind one frontend: a handle for each, and the choice of core for a request.

A request goes to the least loaded live core (fewest live requests routed there), except that a
request about an image that a core holds already (its pixels, and likely its encoder output and
image KV blocks) goes to that core, unless it is busier than the least loaded by more than
`affinity_slack` requests: cache hits, without letting one popular picture pile everything on one
core.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from mm_engine.core.pixels import PixelLedger
from mm_engine.engine.process_client import CoreProcess
from mm_engine.request import ImageSpan


@dataclass(eq=False)
class CoreHandle:
    index: int
    client: CoreProcess
    pixels: PixelLedger  # what this core holds of our images
    requests: set[str] = field(default_factory=set)  # live requests routed here
    stats: dict = field(default_factory=dict)
    thread: threading.Thread | None = None
    restarts: int = 0
    down: bool = False  # dead, or restarting: takes no requests
    gone: bool = False  # down for good: its reader thread has ended


def route(cores: list[CoreHandle], spans: list[ImageSpan], affinity_slack: int) -> CoreHandle | None:
    """The core for a request: least loaded, or the one holding its images if not too busy."""
    up = [c for c in cores if not c.down]
    if not up:
        return None
    least = min(up, key=lambda c: (len(c.requests), c.index))
    if spans:
        near = [c for c in up if len(c.requests) <= len(least.requests) + affinity_slack]
        best = max(near, key=lambda c: (c.pixels.held_bytes(spans), -len(c.requests), -c.index))
        if best.pixels.held_bytes(spans):
            return best
    return least
