"""The draining server says it serves only once SIGTERM would drain it: before its signal handlers are
in place a SIGTERM kills the process outright (exit -15), which is how a supervisor that had taken
an API server for ready lost it in a drain (tests/system/test_api_servers.py, under load)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, signal, socket
import uvicorn
from mm_engine.api.draining_server import DrainingServer

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

seen = []
def serving():
    seen.append(signal.getsignal(signal.SIGTERM))
    server.should_exit = True

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
config = uvicorn.Config(app, log_level="warning", lifespan="on")
server = DrainingServer(config, llm=None, shutdown_timeout=1.0, on_serving=serving)
server.run(sockets=[sock])
assert len(seen) == 1 and seen[0] == server.handle_exit, seen
print("ok")
"""


def test_it_says_it_serves_only_with_its_drain_handler_in_place():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
