"""The Batch API on a real server (the demo model), through the official `openai` client: a
200-line captioning batch end to end, malformed lines, a file that is not JSONL, cancellation, the
files routes and their key, a batch running while interactive streams are served, and a server
killed mid-batch that resumes without losing or repeating a request."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from helpers.api import chat_messages, engine_idle, run_server, wait_until
from helpers.batch import (
    answers,
    caption_line,
    entries,
    expected_captions,
    finished,
    jsonl,
    scene_urls,
    wait_for,
)
from mm_engine import LLM, SamplingParams
from mm_engine.config import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

DEMO = str(default_model_path())
KEY = "sekrit"
SCHEMA = {"type": "json_schema", "json_schema": {"name": "caption", "schema": {
    "type": "object", "properties": {"caption": {"type": "string", "maxLength": 40}}, "required": ["caption"],
    "additionalProperties": False}}}  # fmt: skip
FLAGS = ["--served-model-name", "demo", "--api-key", KEY, "--max-batch-file-bytes", str(4 * 1024**2),
         "--max-model-len", "512"]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batches")
    with run_server(DEMO, *FLAGS, "--batch-dir", str(folder)) as s:
        yield s


@pytest.fixture(scope="module")
def ref():
    return LLM(DEMO, max_model_len=512)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


def submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions"):
    f = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"job": "test"})  # fmt: skip


def test_200_line_captioning_batch_end_to_end(server, ref):
    client = client_of(server)
    urls = scene_urls(200)
    batch = submit(client, [caption_line(f"img-{i}", u, max_tokens=16) for i, u in enumerate(urls)])
    assert re.fullmatch(r"batch_[0-9a-f]{32}", batch.id) and batch.status == "validating"
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "completed", batch.errors
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, 200, 0)
    assert batch.error_file_id is None and batch.metadata == {"job": "test"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    got = answers(client, batch)
    want = expected_captions(ref, urls, max_tokens=16)
    assert got == {f"img-{i}": w for i, w in enumerate(want)}
    bodies = [e["response"]["body"] for e in entries(client, batch.output_file_id)]
    assert batch.usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies) > 200
    assert client.batches.list(limit=100).data[0].id == batch.id
    out = client.files.retrieve(batch.output_file_id)
    assert out.purpose == "batch_output" and out.bytes == len(client.files.content(out.id).content)
    wait_until(lambda: engine_idle(server.base_url), what="every block free")


def test_malformed_lines_go_to_the_error_file_with_their_numbers(server, ref):
    client = client_of(server)
    (url,) = scene_urls(1, seed=7)
    good = caption_line("good", url, max_tokens=8)
    lines = [
        good,
        b"{not json",
        {"method": "POST", "url": "/v1/chat/completions", "body": good["body"]},  # no custom_id
        {**good},  # the same custom_id again
        {**good, "custom_id": "url", "url": "/v1/embeddings"},
        {**good, "custom_id": "stream", "body": {**good["body"], "stream": True}},
        {**good, "custom_id": "unknown", "body": {**good["body"], "temprature": 0.5}},
        caption_line("bad-image", "data:image/png;base64,AAAA"),  # runs, and fails as HTTP would: 400
        {**good, "custom_id": "logprobs", "body": {**good["body"], "logprobs": True, "top_logprobs": 2}},
        {**good, "custom_id": "json", "body": {**good["body"], "max_tokens": 40, "response_format": SCHEMA}},
    ]
    batch = wait_for(client, submit(client, lines).id, finished)
    assert batch.status == "completed"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (10, 3, 7)
    errors = {e["error"]["line"]: e for e in entries(client, batch.error_file_id) if e["error"]}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7]
    assert errors[4]["error"]["code"] == "duplicate_custom_id" and errors[4]["custom_id"] == "good"
    assert errors[5]["error"]["code"] == "mismatched_endpoint"
    assert "stream" in errors[6]["error"]["message"] and "temprature" in errors[7]["error"]["message"]
    (failed,) = [e for e in entries(client, batch.error_file_id) if e["response"]]
    assert failed["custom_id"] == "bad-image" and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["param"] == "messages[0].content[0].image_url"
    out = {e["custom_id"]: e["response"]["body"] for e in entries(client, batch.output_file_id)}
    (want,) = expected_captions(ref, [url], max_tokens=8)
    assert out["good"]["choices"][0]["message"]["content"] == want
    assert len(out["logprobs"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert json.loads(out["json"]["choices"][0]["message"]["content"])["caption"]  # structured output

    f = client.files.create(file=("x.jsonl", b"just some text\nand more\n"), purpose="batch")
    failed = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id, finished)  # fmt: skip
    assert failed.status == "failed" and failed.errors.data[0].code == "invalid_file"
    assert "JSONL" in failed.errors.data[0].message and failed.output_file_id is None


def test_cancel_aborts_what_is_in_flight_and_keeps_what_finished(server):
    client = client_of(server)
    urls = scene_urls(40, seed=3)
    lines = [caption_line(f"c{i}", u, max_tokens=200, ignore_eos=True) for i, u in enumerate(urls)]
    batch = submit(client, lines)
    wait_for(client, batch.id, lambda b: b.status == "in_progress")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_for(client, batch.id, finished)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 40
    assert len(answers(client, batch)) == batch.request_counts.completed
    wait_until(lambda: engine_idle(server.base_url), what="every block free after the cancel")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_files_routes_need_the_key_and_check_uploads(server):
    client = client_of(server)
    f = client.files.create(file=("a.jsonl", b'{"x": 1}\n'), purpose="batch")
    assert re.fullmatch(r"file-[0-9a-f]{32}", f.id) and f.bytes == 9 and f.filename == "a.jsonl"
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == b'{"x": 1}\n'
    assert f.id in [x.id for x in client.files.list(purpose="batch").data]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError, match="over the limit") as info:
        client.files.create(file=("big.jsonl", b"x" * (4 * 1024**2 + 1)), purpose="batch")
    assert info.value.status_code == 413
    for path in ("../../etc/passwd", "file-" + "0" * 32, "file-x"):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(path)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    base = server.base_url
    routes = [
        ("GET", "/v1/files"),
        ("GET", f"/v1/files/{f.id}"),
        ("GET", f"/v1/files/{f.id}/content"),
        ("DELETE", f"/v1/files/{f.id}"),
        ("POST", "/v1/files"),
        ("GET", "/v1/batches"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches/batch_x"),
        ("POST", "/v1/batches/batch_x/cancel"),
    ]
    for method, path in routes:
        assert httpx.request(method, base + path).status_code == 401, path
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)


def test_interactive_streams_are_served_while_a_batch_runs(server, ref):
    client = client_of(server)
    urls = scene_urls(16, seed=5)
    lines = [caption_line(f"b{i}", urls[i % 16], max_tokens=400, ignore_eos=True) for i in range(400)]
    batch = submit(client, lines)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 4)
    (url,) = scene_urls(1, seed=11)
    want = ref.chat(chat_messages(url, "Describe the image."), SamplingParams(temperature=0, max_tokens=12))
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)

    async def stream() -> str:
        chunks = await aclient.chat.completions.create(
            model="demo",
            messages=chat_messages(url, "Describe the image."),
            max_tokens=12,
            stream=True,
            temperature=0,
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def four() -> list[str]:
        return await asyncio.gather(*[stream() for _ in range(4)])

    assert asyncio.run(four()) == [want[0].outputs[0].text] * 4
    during = client.batches.retrieve(batch.id)
    assert (
        during.status == "in_progress" and during.request_counts.completed < 400
    )  # they did not wait it out
    client.batches.cancel(batch.id)
    wait_for(client, batch.id, finished)


def test_a_server_killed_mid_batch_resumes_it_losing_and_repeating_nothing(tmp_path, ref):
    urls = scene_urls(30, seed=9)
    lines = [caption_line(f"k{i}", u, max_tokens=24) for i, u in enumerate(urls)]
    flags = [*FLAGS, "--batch-dir", str(tmp_path), "--batch-max-in-flight", "2"]
    with run_server(DEMO, *flags) as s:
        client = client_of(s)
        batch = submit(client, lines)
        wait_for(client, batch.id, lambda b: b.request_counts.completed >= 6)
        s.proc.kill()  # no drain, no goodbye: as a crash would
        s.proc.wait(timeout=30)
    with run_server(DEMO, *flags) as s:
        client = client_of(s)
        batch = wait_for(client, batch.id, finished)
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed) == (30, 30)
        got = answers(client, batch)  # each custom_id once
        want = expected_captions(ref, urls, max_tokens=24)
        assert got == {f"k{i}": w for i, w in enumerate(want)}
