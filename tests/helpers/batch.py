"""Shared by the batch API tests: files of batch lines over the demo model's scenes, and their
answers from the offline engine."""

from __future__ import annotations

import io
import json
import time

import msgspec
import openai

from helpers.api import data_url
from mm_engine import LLM, SamplingParams
from mm_engine.demo.scenes import CAPTION_PROMPT, held_out_scenes


def scene_urls(n: int, seed: int = 0) -> list[str]:
    urls = []
    for scene in held_out_scenes(n, seed):
        buf = io.BytesIO()
        scene.image.save(buf, "PNG")
        urls.append(data_url(buf.getvalue()))
    return urls


def caption_messages(url: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": CAPTION_PROMPT}]
    return [{"role": "user", "content": content}]


def caption_line(custom_id: str, url: str, **params) -> dict:
    body = {"model": "demo", "messages": caption_messages(url), "temperature": 0, **params}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def expected_captions(llm: LLM, urls: list[str], **params) -> list[str]:
    outs = llm.chat([caption_messages(u) for u in urls], SamplingParams(temperature=0, **params))
    return [o.outputs[0].text for o in outs]


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout: float = 300.0):
    """Poll the batch until `done(batch)`; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch still {batch.status} ({batch.request_counts})")
        time.sleep(0.1)


def finished(batch) -> bool:
    return batch.status in ("completed", "failed", "cancelled", "expired")


def entries(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [msgspec.json.decode(line) for line in client.files.content(file_id).content.splitlines()]


def answers(client: openai.OpenAI, batch) -> dict[str, str]:
    """custom_id -> the answer's text, from the output file (each custom_id at most once)."""
    found = entries(client, batch.output_file_id)
    ids = [e["custom_id"] for e in found]
    assert len(ids) == len(set(ids)), "a request was answered twice"
    return {e["custom_id"]: e["response"]["body"]["choices"][0]["message"]["content"] for e in found}
