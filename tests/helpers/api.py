"""Shared by the API tests: images good and bad, a real server subprocess, metric parsing."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from helpers.images import make_image

ROOT = Path(__file__).resolve().parents[2]
# Small pools keep the tiny model fast; the same settings are used for the offline reference.
ENGINE_KW = {"kv_cache_memory_bytes": 16 * 1024**2, "max_model_len": 256}
ENGINE_FLAGS = ["--kv-cache-memory-bytes", str(16 * 1024**2), "--max-model-len", "256"]
PROMPT = "what is this"


def image_bytes(seed: int, fmt: str = "PNG", size: tuple[int, int] = (40, 30)) -> bytes:
    buf = io.BytesIO()
    make_image(seed, size).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def chat_messages(url: str, text: str = PROMPT) -> list[dict]:
    """A user turn with one image then a question: the shape the caption route builds too."""
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` but whose data is a few bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def truncated_jpeg() -> bytes:
    data = image_bytes(3, "JPEG", (64, 64))
    return data[: len(data) // 2]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (labels must match exactly, in any order)."""
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if found == labels:
            return float(m.group(3))
    raise KeyError(f"{name}{labels} not in metrics")


def wait_until(check: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `check` until true; the timeout only turns a hang into a failure, it is no assertion."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def engine_idle(base_url: str) -> bool:
    text = httpx.get(base_url + "/metrics").text
    return (
        metric(text, "mm_engine:num_requests_running") == 0
        and metric(text, "mm_engine:num_requests_waiting") == 0
        and metric(text, "mm_engine:kv_cache_usage_perc", pool="text") == 0
        and metric(text, "mm_engine:kv_cache_usage_perc", pool="image") == 0
    )


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, base_url: str, log: list[str]) -> None:
        self.proc = proc
        self.base_url = base_url
        self.log = log  # the server's output, read by a thread so the pipe never fills up


@contextlib.contextmanager
def run_server(model: str, *flags: str, timeout: float = 120.0) -> Iterator[ServerProcess]:
    """`python -m mm_engine.api.server MODEL --port 0 ...`; yields once /health answers 200."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    if "--batch-dir" not in flags:  # not the user's cache: tests that need batches give a folder
        flags = (*flags, "--batch-dir", "none")
    cmd = [sys.executable, "-m", "mm_engine.api.server", model, "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(
        [*cmd, "--no-access-log", *ENGINE_FLAGS, *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = ""
        deadline = time.monotonic() + timeout
        while "serving" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit code {proc.poll()})")
        base_url = re.search(r"http://\S+", line).group(0)
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
        wait_until(lambda: _healthy(base_url), timeout, "the server's /health")
        yield ServerProcess(proc, base_url, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health").status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def served_in_process(path: str, **engine_args) -> Iterator[tuple]:
    """The app on an in-process AsyncLLM: (the official openai client, the raw HTTP client), both
    on Litestar's test client; the engine is shut down afterwards."""
    import asyncio

    import openai
    from litestar.testing import TestClient

    from mm_engine.api.app import create_app
    from mm_engine.api.settings import ServerSettings
    from mm_engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(path, **engine_args)
    try:
        with TestClient(create_app(llm, ServerSettings(served_model_names=["m"]))) as http:
            base = str(http.base_url) + "/v1"
            yield openai.OpenAI(base_url=base, api_key="x", http_client=http, max_retries=0), http
    finally:
        asyncio.run(llm.shutdown())
