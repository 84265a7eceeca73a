"""One of the API servers that `mm-engine serve --api-server-count N` runs (api/supervisor.py):
`python -m mm_engine.api.frontend_worker`, its job as JSON on stdin (the serve flags, its index,
the listening socket's fd, its socket pair with each engine core, the file that says it is ready).

It serves the app like a single server does, on the inherited socket, with an `AsyncMPLLM`
attached to cores it did not start. It stops when the supervisor goes away.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path


def _watch_parent(server) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    server.should_exit = True  # the supervisor is gone: nobody restarts or stops us


def main() -> int:
    from mm_engine.api.server import make_llm_and_settings, serve_on

    job = json.loads(sys.stdin.buffer.read())
    args = argparse.Namespace(**job["args"])
    index = job["index"]
    llm, settings, exit_ = make_llm_and_settings(args, [tuple(pair) for pair in job["cores"]], index)
    sock = socket.socket(fileno=job["fd"])

    def started(server) -> None:
        threading.Thread(target=_watch_parent, args=(server,), daemon=True).start()

    # Ready only once serving: the supervisor then says the server is up and may pass on SIGTERM,
    # which must find the draining handler, not the default one that kills the process.
    def serving() -> None:
        Path(job["ready_file"]).touch()

    return serve_on(args, settings, llm, exit_, sock, on_start=started, on_serving=serving)


if __name__ == "__main__":
    sys.exit(main())
