"""A real server (`python -m mm_engine.api.server`, uvicorn on 127.0.0.1) used through httpx and
the official `openai` client: answers equal the offline engine's, bad input gets a 4xx in OpenAI's
shape and leaves no block behind, concurrent and disconnecting clients, SIGTERM drain.

One server serves the whole module; the drain test stops it, so it comes last."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from helpers.api import (
    ENGINE_KW,
    PROMPT,
    chat_messages,
    data_url,
    engine_idle,
    image_bytes,
    metric,
    png_claiming,
    run_server,
    truncated_jpeg,
    wait_until,
)
from mm_engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

MODEL = "tiny"
CAPTION_PROMPT = "Describe the image."


@pytest.fixture(scope="module")
def server(clip_llama):
    flags = ["--served-model-name", MODEL, "--max-body-bytes", "262144", "--max-images-per-request", "2",
             "--shutdown-timeout", "120", "--default-max-tokens", "8", "--header-timeout", "2",
             "--allow-client-priority"]  # fmt: skip
    with run_server(clip_llama, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def ref(clip_llama):
    return LLM(clip_llama, **ENGINE_KW)


def alone(ref: LLM, png: bytes, text: str, **params) -> str:
    """The offline engine's answer to this one request, run by itself."""
    out = ref.chat(chat_messages(data_url(png), text), SamplingParams(**params))
    return out[0].outputs[0].text


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_chat_with_image_data_url(server, ref):
    png = image_bytes(11)
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == [MODEL]
    expected = alone(ref, png, PROMPT, max_tokens=9, temperature=0.0)
    kwargs = {"model": MODEL, "messages": chat_messages(data_url(png)), "max_tokens": 9, "temperature": 0}
    resp = client.chat.completions.create(**kwargs, extra_body={"priority": 3})
    assert resp.choices[0].message.content == expected and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 9 and resp.model == MODEL

    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert (
        chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.total_tokens == resp.usage.total_tokens
    )

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**kwargs, "n": 200})
    assert err.value.body["param"] == "n"  # at most 128
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**{**kwargs, "model": "gpt-4o"})


def test_httpx_caption_upload_json_and_stream(server, ref):
    png = image_bytes(12, "JPEG")
    expected = alone(ref, png, CAPTION_PROMPT, max_tokens=8, temperature=0.0)  # default max tokens: 8
    url = server.base_url + "/v1/caption"
    r = httpx.post(url, files={"image": ("photo.jpg", png, "image/jpeg")})
    assert r.status_code == 200 and r.json()["text"] == expected and r.json()["model"] == MODEL
    with httpx.stream("POST", url, files={"image": ("photo.jpg", png)}, data={"stream": "true"}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["text"] for e in events[:-1]) == expected


def _chat(body: dict) -> dict:
    return {"json": {"model": MODEL, "messages": chat_messages(data_url(image_bytes(1))), **body}}


def _caption(*images: bytes, **fields: str) -> dict:
    return {"files": [("image", (f"img{i}.png", b)) for i, b in enumerate(images)], "data": fields}


BAD_INPUTS = {
    "truncated jpeg": ("/v1/caption", _caption(truncated_jpeg()), 400, "image"),
    "random bytes named .png": ("/v1/caption", _caption(bytes(range(256)) * 8), 400, "image"),
    "1x1 image": ("/v1/caption", _caption(image_bytes(1, size=(1, 1))), 400, "image"),
    "png header 30000x30000": ("/v1/caption", _caption(png_claiming(30000, 30000)), 400, "image"),
    "png header 12000x12000": ("/v1/caption", _caption(png_claiming(12000, 12000)), 400, "image"),
    "body over the limit": ("/v1/caption", _caption(b"\0" * 400_000), 413, None),
    "more images than allowed": ("/v1/caption", _caption(*[image_bytes(i) for i in range(3)]), 400, "image"),
    "max_tokens 0": ("/v1/chat/completions", _chat({"max_tokens": 0}), 400, "max_tokens"),
    "max_tokens -1": ("/v1/chat/completions", _chat({"max_tokens": -1}), 400, "max_tokens"),
    "max_tokens 10**9": ("/v1/chat/completions", _chat({"max_tokens": 10**9}), 400, "max_tokens"),
    "caption max_tokens 10**9": (
        "/v1/caption",
        _caption(image_bytes(1), max_tokens=str(10**9)),
        400,
        "max_tokens",
    ),
    "missing image part": ("/v1/caption", {"files": {"prompt": (None, "hello")}}, 400, "image"),
    "unknown model": ("/v1/chat/completions", _chat({"model": "llava-13b"}), 404, "model"),
    "malformed json": (
        "/v1/chat/completions",
        {"content": b'{"messages": [', "headers": {"content-type": "application/json"}},
        400,
        None,
    ),  # fmt: skip
    "wrong content type": (
        "/v1/chat/completions",
        {"content": b"{}", "headers": {"content-type": "text/plain"}},
        415,
        None,
    ),
    "image_url to 127.0.0.1": (
        "/v1/chat/completions",
        _chat({"messages": chat_messages("http://127.0.0.1:8000/metrics")}),
        400,
        "messages[0].content[0].image_url",
    ),
    "too many stop strings": (
        "/v1/chat/completions",
        _chat({"stop": ["a", "b", "c", "d", "e"]}),
        400,
        "stop",
    ),
    "n=0": ("/v1/chat/completions", _chat({"n": 0}), 400, "n"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_4xx_in_openai_shape_and_leaves_nothing_behind(server, case):
    path, kwargs, status, param = BAD_INPUTS[case]
    r = httpx.post(server.base_url + path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert not re.search(r"Traceback|/tmp|\b0x[0-9a-f]{4,}", error["message"])
    assert httpx.get(server.base_url + "/health").status_code == 200
    wait_until(lambda: engine_idle(server.base_url), what="empty pools")


def _mixed_request(k: int, stream: bool | None = None) -> tuple[dict, tuple, bool]:
    """Request k of the load tests: (httpx kwargs, what decides its answer, streaming).

    Captions and chats, streaming or not, about 4 images, greedy (k < 48) or seeded sampling:
    16 different questions, each asked several times, some at once (so they share cached KV)."""
    caption, img = k % 2 == 1, (k // 4) % 4
    stream = (k // 2) % 2 == 0 if stream is None else stream
    png, n = image_bytes(img), 4 + img
    sampling = {"temperature": 0.7, "seed": 100 + img} if k >= 48 else {"temperature": 0.0}
    fields = {"max_tokens": n, "stream": stream, **sampling}
    if caption:  # form fields are strings
        data = {a: str(b).lower() if isinstance(b, bool) else str(b) for a, b in fields.items()}
        kwargs = {"url": "/v1/caption", "files": {"image": ("x.png", png)}, "data": data}
    else:
        body = {"model": MODEL, "messages": chat_messages(data_url(png)), **fields}
        kwargs = {"url": "/v1/chat/completions", "json": body}
    return kwargs, (CAPTION_PROMPT if caption else PROMPT, img, n, tuple(sampling.items())), stream


_ALONE: dict[tuple, str] = {}


def _expected(ref: LLM, k: int) -> str:
    """The offline engine's answer to request k asked alone (each different question once)."""
    text, img, n, sampling = key = _mixed_request(k)[1]
    if key not in _ALONE:
        _ALONE[key] = alone(ref, image_bytes(img), text, max_tokens=n, **dict(sampling))
    return _ALONE[key]


def _text_of(events: list[str], caption: bool) -> str:
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" not in chunks[-1]
    if caption:
        return "".join(c["text"] for c in chunks)
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


async def _send(client: httpx.AsyncClient, kwargs: dict, stream: bool) -> str:
    kwargs = dict(kwargs)
    url = kwargs.pop("url")
    caption = url == "/v1/caption"
    if not stream:
        r = await client.post(url, **kwargs)
        assert r.status_code == 200, r.text
        return r.json()["text"] if caption else r.json()["choices"][0]["message"]["content"]
    async with client.stream("POST", url, **kwargs) as r:
        assert r.status_code == 200
        return _text_of([line[6:] async for line in r.aiter_lines() if line.startswith("data: ")], caption)


def test_64_concurrent_mixed_requests_equal_each_run_alone(server, ref):
    """Caption uploads and chats, streaming and not, greedy and seeded sampling, all at once."""
    requests = [_mixed_request(k) for k in range(64)]
    expected = [_expected(ref, k) for k in range(64)]

    async def load():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*[_send(client, kw, stream) for kw, _, stream in requests])

    assert asyncio.run(load()) == expected
    wait_until(lambda: engine_idle(server.base_url), what="empty pools")


def test_disconnecting_streams_are_aborted_and_the_rest_complete(server, ref):
    """40 streaming clients; 10 of them (long answers) hang up after two events."""
    metrics = lambda: httpx.get(server.base_url + "/metrics").text  # noqa: E731
    aborted_before = metric(metrics(), "mm_engine:request_success_total", finished_reason="abort")
    staying = [_mixed_request(k, stream=True)[0] for k in range(30)]
    expected = [_expected(ref, k) for k in range(30)]
    leaving = {"model": MODEL, "messages": chat_messages(data_url(image_bytes(9))), "max_tokens": 200,
               "ignore_eos": True, "stream": True}  # fmt: skip

    async def hang_up(client: httpx.AsyncClient) -> int:
        seen = 0
        async with client.stream("POST", "/v1/chat/completions", json=leaving) as r:
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def load():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            tasks = [_send(client, kw, True) for kw in staying] + [hang_up(client) for _ in range(10)]
            return await asyncio.gather(*tasks)

    results = asyncio.run(load())
    assert results[:30] == expected and results[30:] == [2] * 10
    wait_until(lambda: engine_idle(server.base_url), what="every block free")
    aborted = metric(metrics(), "mm_engine:request_success_total", finished_reason="abort") - aborted_before
    assert aborted == 10


def test_non_streaming_client_that_disconnects_is_aborted(server):
    metrics = lambda: httpx.get(server.base_url + "/metrics").text  # noqa: E731
    before = metrics()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                       "ignore_eos": True}).encode()  # fmt: skip
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)

    async def leave_while_running():
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        writer.write(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        await asyncio.to_thread(
            wait_until, lambda: metric(metrics(), "mm_engine:num_requests_running") == 1, what="it runs"
        )
        writer.close()  # gone before the answer
        await writer.wait_closed()

    asyncio.run(leave_while_running())
    wait_until(lambda: engine_idle(server.base_url), what="every block free")
    after = metrics()
    abort = "mm_engine:request_success_total"
    assert metric(after, abort, finished_reason="abort") - metric(before, abort, finished_reason="abort") == 1
    generated = "mm_engine:generation_tokens_total"
    assert metric(after, generated) - metric(before, generated) < 200


def test_half_open_connections_are_closed_after_the_header_timeout(server):
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    conns = [socket.create_connection((url.hostname, url.port)) for _ in range(20)]
    for k, conn in enumerate(conns):
        conn.settimeout(30)
        if k % 2:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # half a request head
    assert httpx.get(server.base_url + "/health").status_code == 200  # serving meanwhile
    for k, conn in enumerate(conns):
        answer = b""
        while chunk := conn.recv(4096):  # returns b"" once the server closes it
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") if k % 2 else answer == b""
        conn.close()


def test_sigterm_drains_running_requests_refuses_new_ones_then_exits(server):
    """Runs last: it stops the module's server."""
    body = {"model": MODEL, "messages": chat_messages(data_url(image_bytes(2))), "max_tokens": 150,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # running
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(server.base_url + "/health").status_code == 503, what="draining")
        refused = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # finished, not cut
    assert server.proc.wait(timeout=120) == 0


def test_cli_module_imports_none_of_the_web_stack():
    """`mm-engine generate` imports the CLI module, which also defines `serve`'s flags; that must
    not pull in uvicorn or Litestar (nor fail where they are missing)."""
    code = "import sys, mm_engine.cli; print([m for m in ('uvicorn', 'litestar') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
