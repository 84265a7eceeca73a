"""Half-open connections are closed: a client that sends nothing, half a request head, or a body
that stops part-way gets 408 (or, having sent nothing, just a close) after the read timeouts; a
slow but steady body and keep-alive requests are served; a client that stops reading a response
is dropped after the send timeout."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from mm_engine.api.timeouts import timed_h11_protocol

HEADER_TIMEOUT, BODY_TIMEOUT = 0.5, 1.0


async def _echo(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = uvicorn.Config(
        _echo, http=timed_h11_protocol(HEADER_TIMEOUT, BODY_TIMEOUT), log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(20)  # far beyond the timeouts: a held connection fails the test, not hangs it
    return conn


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_a_silent_connection_is_closed(port):
    with _connect(port) as conn:
        assert _read_all(conn) == b""  # closed, nothing said: it never asked anything


def test_half_a_request_head_gets_408(port):
    with _connect(port) as conn:
        conn.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\n")
        assert _read_all(conn).startswith(b"HTTP/1.1 408")


def test_a_body_that_stops_gets_408(port):
    with _connect(port) as conn:
        conn.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        assert _read_all(conn).startswith(b"HTTP/1.1 408")


def test_slow_steady_bodies_and_keep_alive_are_served(port):
    with _connect(port) as conn:
        conn.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 8\r\n\r\n")
        for _ in range(8):  # 8 x 0.2 s: longer than the body timeout in all, never silent that long
            time.sleep(0.2)
            conn.sendall(b"y")
        first = conn.recv(65536)
        while not first.endswith(b"yyyyyyyy") and (more := conn.recv(65536)):
            first += more  # the head and the body may come in separate reads
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"yyyyyyyy")
        time.sleep(HEADER_TIMEOUT / 2)
        conn.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")  # the same connection again
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout():
    stopped = []  # (bytes the app handed to the server, what ended it)

    async def endless(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        sent, chunk = 0, b"x" * 65536
        while sent < 1 << 30:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += len(chunk)
            message = await _poll(receive)
            if message is not None and message["type"] == "http.disconnect":
                stopped.append((sent, "disconnect"))
                return
        stopped.append((sent, "ran out"))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    config = uvicorn.Config(
        endless, http=timed_h11_protocol(5.0, 5.0, 0.5), log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        conn = _connect(sock.getsockname()[1])
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")  # and never read
        deadline = time.monotonic() + 20
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
    assert stopped and stopped[0][1] == "disconnect", stopped
    assert stopped[0][0] < 1 << 28  # dropped, not streamed on into the buffers


async def _poll(receive):
    """The next ASGI message if one is ready now, else None."""
    try:
        return await asyncio.wait_for(receive(), 0.0001)
    except TimeoutError:
        return None
