"""The batch runner in-process (Litestar's test client and the official client): a batch past its
completion window expires with what finished kept, two servers on one folder never both run it; and
`mm-engine run-batch` offline, resumed from an output cut mid-line, answering each line once."""

from __future__ import annotations

import asyncio
import time

import msgspec
import openai
import pytest
from litestar.testing import TestClient

from helpers.api import ENGINE_KW, PROMPT, chat_messages, data_url, image_bytes
from helpers.batch import finished, jsonl, wait_for
from mm_engine import LLM, SamplingParams
from mm_engine.api.app import create_app
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM
from mm_engine.cli import main

pytestmark = pytest.mark.slow


def _line(i: int, url: str, **params) -> dict:
    body = {"messages": chat_messages(url), "temperature": 0, **params}
    return {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture
def served(clip_llama, tmp_path):
    llm = AsyncLLM.from_engine_args(clip_llama, **ENGINE_KW)
    settings = ServerSettings(served_model_names=["m"], batch_dir=str(tmp_path), batch_max_in_flight=2)
    apps = []
    try:
        with TestClient(create_app(llm, settings)) as http:
            apps.append(http.app)
            client = openai.OpenAI(
                base_url=str(http.base_url) + "/v1", api_key="x", http_client=http, max_retries=0
            )
            yield client, http
    finally:
        asyncio.run(llm.shutdown())


def test_a_batch_past_its_window_expires_keeping_what_finished(served):
    client, http = served
    url = data_url(image_bytes(4))
    lines = [_line(i, url, max_tokens=100, ignore_eos=True) for i in range(400)]
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert batch.expires_at - batch.created_at == 3600
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 2)
    runner = http.app.state.ctx.batches
    runner.clock = lambda: time.time() + 7200  # two hours on
    runner.wake()
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "expired" and batch.expired_at and 2 <= batch.request_counts.completed < 400
    done = client.files.content(batch.output_file_id).content.splitlines()
    assert len(done) == batch.request_counts.completed
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="9d")


def test_two_servers_on_one_folder_run_each_batch_once(clip_llama, tmp_path, served):
    client, http = served
    other_llm = AsyncLLM.from_engine_args(clip_llama, **ENGINE_KW)
    settings = ServerSettings(served_model_names=["m"], batch_dir=str(tmp_path))
    try:
        with TestClient(create_app(other_llm, settings)) as other_http:
            other = _client(other_http)
            url = data_url(image_bytes(5))
            f = other.files.create(file=("in.jsonl", jsonl([_line(i, url, max_tokens=4) for i in range(6)])),
                                   purpose="batch")  # fmt: skip
            batch = other.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            batch = wait_for(client, batch.id, finished)  # seen, and run, by the first server
            assert batch.status == "completed" and batch.request_counts.completed == 6
            assert len(other.files.content(batch.output_file_id).content.splitlines()) == 6
    finally:
        asyncio.run(other_llm.shutdown())


def test_run_batch_offline_resumes_from_an_output_cut_mid_line(clip_llama, tmp_path, capsys):
    urls = [data_url(image_bytes(s)) for s in range(5)]
    lines = [_line(i, u, max_tokens=6) for i, u in enumerate(urls)]
    completion = {"prompt": [[1, 5, 9], [1, 7]], "max_tokens": 4, "n": 2, "temperature": 0, "logprobs": 1}
    lines.append({"custom_id": "cmpl", "method": "POST", "url": "/v1/completions", "body": completion})
    lines.append({"custom_id": "q0", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    flags = ["--model", clip_llama, "--kv-cache-memory-bytes", str(ENGINE_KW["kv_cache_memory_bytes"]),
             "--max-model-len", str(ENGINE_KW["max_model_len"]), "--no-progress"]  # fmt: skip
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags]) == 0
    first = target.read_bytes().splitlines()
    assert len(first) == 7
    target.write_bytes(b"\n".join(first[:3]) + b"\n" + first[3][:25])  # stopped while writing line 4
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags]) == 0
    assert "resuming: 3 lines" in capsys.readouterr().err
    rows = [msgspec.json.decode(x) for x in target.read_bytes().splitlines()]
    assert len(rows) == 7
    by_id = {r["custom_id"]: r for r in rows if r["response"]}
    assert sorted(by_id) == ["cmpl", "q0", "q1", "q2", "q3", "q4"]  # each once
    (dup,) = [r for r in rows if r["error"]]
    assert dup["error"] == {"code": "duplicate_custom_id", "line": 7, "message": dup["error"]["message"]}
    ref = LLM(clip_llama, **ENGINE_KW)
    for i, url in enumerate(urls):
        want = ref.chat(chat_messages(url, PROMPT), SamplingParams(temperature=0, max_tokens=6))
        got = by_id[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"]
        assert got == want[0].outputs[0].text
    choices = by_id["cmpl"]["response"]["body"]["choices"]
    assert len(choices) == 4 and choices[0]["logprobs"]["tokens"]
