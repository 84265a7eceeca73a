"""The Litestar app in-process (Litestar's test clients): answers equal the offline engine's, the
error shape, metrics, back-pressure (429), draining (503), and a fault in the model's forward."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from litestar.testing import TestClient

from helpers.api import ENGINE_KW, PROMPT, chat_messages, data_url, image_bytes, metric, wait_until
from mm_engine import LLM, SamplingParams
from mm_engine.api.app import create_app
from mm_engine.api.metrics import Metrics
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM
from mm_engine.engine.async_client import AsyncMPLLM
from mm_engine.engine.async_types import EngineDrainingError

SETTINGS = ServerSettings(served_model_names=["tiny", "tiny-alias"], default_max_tokens=8)


@pytest.fixture(scope="module")
def ref(clip_llama):
    return LLM(clip_llama, **ENGINE_KW)


@pytest.fixture(
    scope="module",
    params=["thread", pytest.param("process", marks=[pytest.mark.slow, pytest.mark.subprocess])],
)
def llm(clip_llama, request):
    """The app's engine core on a thread of this process, and in a process of its own."""
    kind = AsyncLLM if request.param == "thread" else AsyncMPLLM
    llm = kind.from_engine_args(clip_llama, **ENGINE_KW, listener=Metrics(128))
    yield llm
    asyncio.run(llm.shutdown())


def _in_process(llm):
    if not isinstance(llm, AsyncLLM):
        # These spy on LLMEngine.add_processed by monkeypatching it; with the process engine the
        # core runs in another process, where the patch cannot reach (the HTTP answers themselves
        # are checked for both engines by the other tests here).
        pytest.skip("spies on the in-process engine's add_processed, which runs in the core process here")


@pytest.fixture(scope="module")
def client(llm):
    with TestClient(create_app(llm, SETTINGS)) as c:
        yield c


@pytest.fixture
def make_llm(clip_llama):
    """Fresh engines for tests that break or drain them."""
    made = []

    def make(**kw):
        made.append(AsyncLLM.from_engine_args(clip_llama, **{**ENGINE_KW, **kw}))
        return made[-1]

    yield make
    for llm in made:
        asyncio.run(llm.shutdown())


def asgi_client(app) -> httpx.AsyncClient:
    """Requests served on the caller's event loop, so several can wait on the engine at once
    (Litestar's AsyncTestClient runs the app in a portal thread and blocks the loop meanwhile)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_events(text: str) -> list:
    lines = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def greedy_chat(ref: LLM, png: bytes, text: str, n: int) -> str:
    out = ref.chat(chat_messages(data_url(png), text), SamplingParams(max_tokens=n, temperature=0.0))
    return out[0].outputs[0].text


def test_caption_json_and_stream_equal_offline_engine(client, ref):
    png = image_bytes(1)
    expected = greedy_chat(ref, png, "Describe the image.", 6)
    r = client.post("/v1/caption", files=[("image", ("a.png", png))], data={"max_tokens": "6"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "caption" and body["model"] == "tiny" and body["text"] == expected
    assert body["usage"]["completion_tokens"] == 6 and body["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 6

    r = client.post(
        "/v1/caption", files=[("image", ("a.png", png))], data={"max_tokens": "6", "stream": "true"}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    assert "".join(c["text"] for c in chunks) == expected
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["object"] == "caption.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_caption_with_placeholder_prompt_and_two_images(client, ref):
    a, b = image_bytes(4), image_bytes(5)
    prompt = "USER: <image> <image> what is this ASSISTANT:"
    expected = ref.generate(
        {"prompt": prompt, "multi_modal_data": {"image": [a, b]}}, SamplingParams(max_tokens=5, temperature=0)
    )[0]
    r = client.post(
        "/v1/caption",
        files=[("image", ("a.png", a)), ("image", ("b.png", b))],
        data={"prompt": prompt, "max_tokens": "5", "model": "tiny-alias"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == expected.outputs[0].text and r.json()["model"] == "tiny-alias"
    assert r.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_chat_json_and_stream_with_usage(client, ref):
    png = image_bytes(2, "WEBP")
    expected = greedy_chat(ref, png, PROMPT, 7)
    body = {"model": "tiny", "messages": chat_messages(data_url(png, "webp")), "max_completion_tokens": 7,
            "temperature": 0}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["content"] == expected
    assert out["choices"][0]["message"]["role"] == "assistant" and out["usage"]["completion_tokens"] == 7

    r = client.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = sse_events(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    assert all(c["usage"] is None for c in chunks[:-1])


def test_text_only_chat_and_stop_string(client, ref):
    messages = [{"role": "system", "content": "tell me"}, {"role": "user", "content": "what color is this"}]
    full = ref.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    stop = full.split()[2]  # a word the greedy answer reaches
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0, "stop": stop}
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["message"]["content"]
    assert full.startswith(choice["message"]["content"])


def test_priority_reaches_the_engine_when_the_operator_allows_it(llm, monkeypatch):
    _in_process(llm)
    seen = []
    add = llm.engine.add_processed
    monkeypatch.setattr(llm.engine, "add_processed", lambda *a, **k: (seen.append(a[-1]), add(*a, **k))[1])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -5}
    settings = ServerSettings(served_model_names=["tiny"], allow_client_priority=True)
    with TestClient(create_app(llm, settings)) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        r = client.post(
            "/v1/caption", files=[("image", ("a", image_bytes(1)))], data={"max_tokens": "2", "priority": "7"}
        )
        assert r.status_code == 200
    assert seen == [-5, 7]


def test_caption_ignore_eos_reaches_the_engine(client, llm, monkeypatch):
    _in_process(llm)
    seen = []
    add = llm.engine.add_processed
    monkeypatch.setattr(llm.engine, "add_processed", lambda *a, **k: (seen.append(a[3]), add(*a, **k))[1])
    for flag in ("true", "false"):
        data = {"max_tokens": "3", "ignore_eos": flag}
        r = client.post("/v1/caption", files=[("image", ("a", image_bytes(1)))], data=data)
        assert r.status_code == 200, r.text
    assert [p.ignore_eos for p in seen] == [True, False]


def test_models_health_metrics_openapi(client):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    assert client.get("/v1/models/tiny").json()["max_model_len"] == ENGINE_KW["max_model_len"]
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    platform = health.json()["platform"]  # which CPU kernels serve: the widest variant cpuid allows
    assert platform["device"] == "cpu" and platform["attention_backend"] == "cpu"
    assert platform["cpu_variant"] in ("avx512", "avx2", "portable") and "decode" in platform["cpu_kernels"]
    # One request of each kind here (the test must not lean on others having run first on this
    # worker); the process engine's stats reach the server a moment after its outputs.
    client.post("/v1/caption", files=[("image", ("a.png", image_bytes(2)))], data={"max_tokens": "3"})
    client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )

    def seen(kind: str) -> bool:
        return (
            metric(client.get("/metrics").text, "mm_engine:inter_token_latency_seconds_count", modality=kind)
            > 0
        )

    wait_until(lambda: seen("image") and seen("text"), what="both kinds in the metrics")
    text = client.get("/metrics").text
    kernels = ",".join(platform["cpu_kernels"])
    labels = {"variant": platform["cpu_variant"], "kernels": kernels, "attention_backend": "cpu"}
    assert metric(text, "mm_engine:cpu_kernels_info", **labels) == 1
    counters = (
        "encoder_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
    )
    for name in ("num_requests_running", "num_requests_waiting", *counters):
        metric(text, "mm_engine:" + name)
    for pool in ("text", "image"):
        metric(text, "mm_engine:kv_cache_usage_perc", pool=pool)
        metric(text, "mm_engine:prefix_cache_queries_total", pool=pool)
        metric(text, "mm_engine:prefix_cache_hits_total", pool=pool)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "inter_token_latency_seconds"):  # fmt: skip
        assert metric(text, f"mm_engine:{name}_count", modality="image") > 0
        assert metric(text, f"mm_engine:{name}_count", modality="text") > 0
    assert metric(text, "mm_engine:scheduler_step_seconds_count") > 0
    assert metric(text, "mm_engine:batch_fill_ratio_count") > 0
    assert metric(text, "mm_engine:generation_tokens_total") > 0
    paths = client.get("/schema/openapi.json").json()["paths"]
    assert {"/v1/caption", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(paths)


def _blocking_forward(engine):
    """Make the engine's steps wait for `release`; `entered` is set once one is waiting."""
    entered, release = threading.Event(), threading.Event()
    execute = engine.core.runner.execute

    def blocked(*args, **kwargs):
        entered.set()
        release.wait(60)
        return execute(*args, **kwargs)

    engine.core.runner.execute = blocked
    return entered, release


def test_full_waiting_queue_gives_429_with_retry_after(make_llm):
    llm = make_llm(max_num_seqs=1, max_waiting_requests=2)
    entered, release = _blocking_forward(llm.engine)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def scenario():
        async with asgi_client(create_app(llm, SETTINGS)) as c:
            post = lambda: asyncio.ensure_future(c.post("/v1/chat/completions", json=body))  # noqa: E731
            running = post()
            await asyncio.to_thread(entered.wait, 60)  # the engine is stuck in a step with it
            queued = [post(), post()]
            while llm.num_unfinished < 3:  # both wait in the inbox, in this order
                await asyncio.sleep(0.01)
            extra = post()
            while llm.num_unfinished < 4:
                await asyncio.sleep(0.01)
            release.set()  # all three adds reach the scheduler together: the queue holds two
            return await asyncio.gather(running, *queued, extra)

    *served, refused = asyncio.run(scenario())
    assert [r.status_code for r in served] == [200, 200, 200]
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert llm.stats()["num_requests_waiting"] == 0


def test_draining_refuses_new_requests_with_503(make_llm):
    llm = make_llm()
    llm.start_drain()
    with TestClient(create_app(llm, SETTINGS)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "draining"
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"


def test_health_reports_a_stalled_and_a_dead_engine_loop(make_llm):
    llm = make_llm(stall_timeout=0.2)
    entered, release = _blocking_forward(llm.engine)
    with TestClient(create_app(llm, SETTINGS)) as c:
        assert c.get("/health").status_code == 200
        hi = {"messages": [{"role": "user", "content": "hi"}]}
        waiting = threading.Thread(target=c.post, args=("/v1/chat/completions",), kwargs={"json": hi})
        waiting.start()
        entered.wait(60)
        wait_until(lambda: llm.health().stalled, what="a stall")  # a step that never ends
        stalled = c.get("/health")
        release.set()
        asyncio.run(llm.shutdown())
        dead = c.get("/health")
        refused = c.post("/v1/chat/completions", json=hi)
        waiting.join(60)
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
    assert (
        dead.status_code == 503 and dead.json()["status"] == "dead" and not dead.json()["engine_loop_alive"]
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_drain_timeout_aborts_what_is_left_and_frees_its_blocks(make_llm):
    llm = make_llm()
    entered, release = _blocking_forward(llm.engine)

    async def scenario():
        inputs = await llm.process_prompt("USER: what is this ASSISTANT:")

        async def consume():
            async for _ in llm.generate(inputs, SamplingParams(max_tokens=50, ignore_eos=True)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.to_thread(entered.wait, 60)
        finished_in_time = await llm.drain(timeout=0.01)
        release.set()
        with pytest.raises(EngineDrainingError):
            await task
        return finished_in_time, await llm.call(lambda engine: engine.kv_report())

    finished_in_time, report = asyncio.run(scenario())
    assert not finished_in_time
    assert report["text"]["used_blocks"] == 0 and report["image"]["used_blocks"] == 0


def test_fault_in_model_forward_fails_requests_with_500_and_health_reports_it(make_llm, ref):
    llm = make_llm()
    lm = llm.engine.core.model.language_model
    calls = {"n": 0}
    forward = lm.forward

    def faulty(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 3:  # after the first tokens went out, so a stream breaks mid-way
            raise RuntimeError("shape mismatch at /opt/secret/model.py object at 0x7f00deadbeef")
        return forward(*args, **kwargs)

    lm.forward = faulty
    chat = {"messages": chat_messages(data_url(image_bytes(1))), "max_tokens": 20, "ignore_eos": True}

    async def scenario():
        async with asgi_client(create_app(llm, SETTINGS)) as c:
            stream = await c.post(
                "/v1/chat/completions", json={**chat, "stream": True}
            )  # 2 steps, then fails
            plain = await asyncio.gather(
                c.post("/v1/chat/completions", json=chat),
                c.post("/v1/caption", files=[("image", ("a.png", image_bytes(2)))], data={"max_tokens": "9"}),
            )
            health = await c.get("/health")
            lm.forward = forward  # the fault goes away: the engine serves again
            ok = await c.post("/v1/chat/completions", json={**chat, "max_tokens": 3})
            return stream, plain, health, ok, await c.get("/health"), await c.get("/metrics")

    stream, plain, health, ok, health_after, metrics = asyncio.run(scenario())
    lines = [line for line in stream.text.split("\n\n") if line]
    assert stream.status_code == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "server_error"
    assert json.loads(lines[1][6:])["choices"][0]["delta"]["content"]  # it failed mid-stream
    for r in plain:
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    for text in (stream.text, *(r.text for r in plain), health.text):
        assert "secret" not in text and "0x7f" not in text and "mismatch" not in text
    assert health.status_code == 503
    assert health.json()["status"] == "faulted" and health.json()["faults_total"] >= 1
    assert health.json()["last_error"] == "engine step failed (RuntimeError)"
    assert ok.status_code == 200 and health_after.status_code == 200
    for pool in ("text", "image"):
        assert metric(metrics.text, "mm_engine:kv_cache_usage_perc", pool=pool) == 0
