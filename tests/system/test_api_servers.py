"""`mm-engine serve --api-server-count 2`: two API-server processes on one port, sharing the engine
core (api/supervisor.py). Answers equal the offline engine's whichever server takes them, both
servers take connections, metrics add up over them, a killed core is restarted for both, and
SIGTERM drains and stops every process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers.api import (
    ENGINE_KW,
    chat_messages,
    data_url,
    engine_idle,
    image_bytes,
    metric,
    run_server,
    wait_until,
)
from mm_engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(clip_llama):
    flags = ["--served-model-name", MODEL, "--api-server-count", "2", "--shutdown-timeout", "60"]
    with run_server(clip_llama, *flags) as s:
        yield s


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _body(k: int, **extra) -> dict:
    return {"model": MODEL, "messages": chat_messages(data_url(image_bytes(k % 3)), f"what is {k % 4}"),
            "max_tokens": 6, "temperature": 0.0, **extra}  # fmt: skip


def _fresh_health(base_url: str) -> dict:
    with httpx.Client(base_url=base_url) as c:  # a new connection: either server may take it
        return c.get("/health").json()


def test_both_servers_answer_like_the_offline_engine_and_metrics_add_up(server, clip_llama):
    ref = LLM(clip_llama, **ENGINE_KW)
    expected = {}
    for k in range(12):
        body = _body(k)
        out = ref.chat(body["messages"], SamplingParams(max_tokens=6, temperature=0.0))
        expected[k] = out[0].outputs[0].text

    async def one(k: int) -> str:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:  # own connection
            r = await c.post("/v1/chat/completions", json=_body(k))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

    async def load():
        return await asyncio.gather(*[one(k % 12) for k in range(36)])

    assert asyncio.run(load()) == [expected[k % 12] for k in range(36)]
    servers = {_fresh_health(server.base_url)["api_server"] for _ in range(40)}
    assert servers == {0, 1}
    wait_until(lambda: engine_idle(server.base_url), what="empty pools")
    for _ in range(6):  # whichever server answers the scrape, the counts are the sum of both
        with httpx.Client(base_url=server.base_url) as c:
            text = c.get("/metrics").text
        assert (
            metric(text, "mm_engine:request_success_total", finished_reason="stop")
            + metric(text, "mm_engine:request_success_total", finished_reason="length")
            == 36
        )


def test_a_killed_core_is_restarted_for_both_servers(server):
    cores = [p for p in _children(server.proc.pid) if "mm_engine.core.process" in _cmdline(p)]
    assert len(cores) == 1
    body = _body(1, max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # running
        os.kill(cores[0], signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])  # failed, with a clear error

    def both_back() -> bool:
        seen = {}
        for _ in range(30):
            h = _fresh_health(server.base_url)
            seen[h["api_server"]] = h
        return set(seen) == {0, 1} and all(h["status"] == "ok" for h in seen.values())

    wait_until(both_back, timeout=120, what="both servers healthy on the new core")
    h = _fresh_health(server.base_url)
    assert "restarted (1 of 3)" in h["last_error"]
    r = httpx.post(server.base_url + "/v1/chat/completions", json=_body(2))
    assert r.status_code == 200
    new = [p for p in _children(server.proc.pid) if "mm_engine.core.process" in _cmdline(p)]
    assert len(new) == 1 and new != cores


def test_sigterm_drains_and_stops_every_process(server):
    """Runs last: it stops the module's server."""
    kids = _children(server.proc.pid)
    assert len(kids) == 3  # two API servers and the core
    body = _body(0, max_tokens=60, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # finished, not cut
    code = server.proc.wait(timeout=120)
    assert code == 0, "".join(server.log[-60:])  # the supervisor's and servers' own words on why
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in kids), what="every child gone")


def test_several_api_servers_need_the_core_process():
    cmd = [sys.executable, "-m", "mm_engine.api.server", "--api-server-count", "2", "--engine-core", "thread"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--api-server-count needs --engine-core process" in done.stderr
