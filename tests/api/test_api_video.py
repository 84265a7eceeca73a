"""Video over HTTP (Qwen2-VL tiny checkpoint, in-process app): an mp4 written here as a `video_url`
data URL on `/v1/chat/completions` and as a `video` file part on `/v1/caption` answers what the
Python API answers for the same clip; hostile clips are 400s in the OpenAI error shape that name
the problem, and the engine keeps serving."""

from __future__ import annotations

import asyncio
import base64
import re

import pytest
from litestar.testing import TestClient

from helpers.api import metric
from helpers.families import greedy
from helpers.video import clip, long_clip, mp4, png_bytes
from mm_engine import LLM
from mm_engine.api.app import create_app
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM

KW = dict(
    kv_cache_memory_bytes=8 * 1024**2, block_size=8, max_num_batched_tokens=16, attention_backend="torch"
)
SETTINGS = ServerSettings(served_model_names=["m"], default_max_tokens=6, max_video_seconds=60.0)
QUESTION = "what happens"


@pytest.fixture(scope="module")
def served(vl_family):
    path, _ = vl_family("qwen2_vl")
    llm = AsyncLLM.from_engine_args(path, **KW, video_limits=SETTINGS.video_limits())
    with TestClient(create_app(llm, SETTINGS)) as http:
        yield path, http
    asyncio.run(llm.shutdown())


@pytest.fixture(scope="module")
def video() -> bytes:
    return mp4(clip(9, 24, (32, 48)), 8)  # 3 s at 8 fps: 6 frames sampled at 2 fps


def chat(http, url: str):
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    return http.post("/v1/chat/completions", json=body)


def test_a_clip_as_video_url_and_as_an_upload_answers_as_the_python_api(served, video):
    path, http = served
    offline = LLM(path, **KW)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = offline.engine.inputs.tokenizer.apply_chat_template(
        messages,
        chat_template=offline.engine.inputs.chat_template,
        tokenize=False,
        add_generation_prompt=True,
    )
    want = offline.generate([{"prompt": text, "multi_modal_data": {"video": video}}], [greedy(6)])[0]
    offline_spans = offline.engine.inputs.process({"prompt": text, "multi_modal_data": {"video": video}})
    offline.close()
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    r = chat(http, url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
    assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    r = http.post(
        "/v1/caption",
        files={"video": ("clip.mp4", video, "video/mp4")},
        data={"prompt": QUESTION, "max_tokens": "6"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == want.outputs[0].text
    _, _, spans = offline_spans
    metrics = http.get("/metrics").text
    # The clip's groups were encoded once, for the chat request: the upload hit the encoder cache.
    assert metric(metrics, "mm_engine:encoded_inputs_total", modality="video") == len(spans)
    assert metric(metrics, "mm_engine:encoded_tokens_total", modality="video") == sum(s.length for s in spans)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: b"", "empty"),
        (lambda: b"\x00garbage" * 50, "not a decodable video"),
        (lambda: mp4(clip(1, 8, (32, 32)), 4)[:900], "not a decodable video|truncated|no frames"),
        (png_bytes, "not a video container"),
        (long_clip, "over the limit of 60 s"),
    ],
)
def test_hostile_clips_are_400s_and_the_engine_keeps_serving(served, video, make, message):
    _, http = served
    url = "data:video/mp4;base64," + base64.b64encode(make()).decode()
    r = chat(http, url)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and re.search(message, error["message"])
    r = http.post(
        "/v1/caption", files={"video": ("clip.mp4", make(), "video/mp4")}, data={"prompt": QUESTION}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "video"
    assert chat(http, "data:video/mp4;base64," + base64.b64encode(video).decode()).status_code == 200


def test_video_counts_urls_and_families_are_checked(served, video):
    _, http = served
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}] * 2 + [{"type": "text", "text": "x"}]
    r = http.post(
        "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": content}]}
    )
    assert r.status_code == 400 and "at most 1 are allowed" in r.json()["error"]["message"]
    r = chat(http, "https://example.com/clip.mp4")
    assert r.status_code == 400 and "not allowed" in r.json()["error"]["message"]
    r = chat(http, "data:image/png;base64,AAAA")
    assert r.status_code == 400 and "video/*" in r.json()["error"]["message"]
