"""Every family through the serving paths: the OpenAI chat route and the multipart caption route
(answers equal the offline engine's, which the family tests hold to transformers'), batch
captioning, metrics and the KV report; and `bench.offline --model` on a family checkpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from litestar.testing import TestClient

from helpers.api import chat_messages, data_url, image_bytes, metric
from helpers.families import assert_all_free, greedy
from mm_engine import LLM
from mm_engine.api.app import create_app
from mm_engine.api.metrics import Metrics
from mm_engine.api.settings import ServerSettings
from mm_engine.engine.async_client import AsyncMPLLM
from mm_engine.jobs.caption import caption_images

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

FAMILIES = [
    "qwen2_5_vl", "qwen3_5", "smolvlm", "internvl", "mistral3", "lighton_ocr", "llava_next",
    "llava_onevision", "gemma3", "glm_ocr", "gemma4", "paddleocr_vl",
]  # fmt: skip
# (Qwen3-VL serves through the same Qwen paths as these two; its model is held to transformers by
# test_qwen_vl.py and test_family_common.py.)
ENGINE = {"kv_cache_memory_bytes": 16 * 1024**2, "block_size": 8, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, vl_family):
    path, _ = vl_family(request.param)
    return path, LLM(path, **ENGINE)


def test_chat_and_caption_routes_answer_as_the_offline_engine(family):
    path, offline = family
    png = image_bytes(3, size=(90, 60))
    want = offline.chat(chat_messages(data_url(png), "what is this"), greedy(7))[0]
    # The server's default: the core in a process, reporting to the app's metrics.
    llm = AsyncMPLLM.from_engine_args(path, **ENGINE, listener=Metrics(128))
    try:
        with TestClient(create_app(llm, ServerSettings(served_model_names=["m"]))) as client:
            body = {"model": "m", "messages": chat_messages(data_url(png)), "max_tokens": 7, "temperature": 0}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text
            assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
            r = client.post(
                "/v1/caption",
                files=[("image", ("a.png", png))],
                data={"prompt": "what is this", "max_tokens": "7"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["text"] == want.outputs[0].text
            metrics = client.get("/metrics").text
            assert metric(metrics, "mm_engine:prompt_tokens_total") == 2 * len(want.prompt_token_ids)
            bad = {**body, "messages": chat_messages("data:image/png;base64,AAAA")}
            r = client.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400 and "error" in r.json()
    finally:
        asyncio.run(llm.shutdown())


def test_batch_captioning(family, tmp_path):
    path, offline = family
    folder = tmp_path / "images"
    folder.mkdir()
    pngs = {f"{k}.png": image_bytes(40 + k, size=(30 + 20 * k, 50)) for k in range(3)}
    for name, data in pngs.items():
        (folder / name).write_bytes(data)
    out = tmp_path / "captions.jsonl"
    summary = caption_images(
        folder, out, llm=offline, prompt="describe the picture", max_tokens=6, progress="none"
    )
    assert summary.captioned == 3 and summary.failed == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    records = {Path(r["image"]).name: r for r in lines}
    for name, data in pngs.items():
        want = offline.chat(chat_messages(data_url(data), "describe the picture"), greedy(6))[0]
        assert records[name]["caption"] == want.outputs[0].text
    assert_all_free(offline)
    report = offline.kv_report()
    assert report["encoder_cache"]["entries"] >= 3


def test_bench_offline_takes_a_family_checkpoint(vl_family, monkeypatch):
    from bench import offline

    monkeypatch.setenv("MM_ENGINE_BENCH_IN_PROCESS", "1")  # its runs without a spawn each

    path, _ = vl_family("qwen2_5_vl")
    res = offline.main(
        ["--model", path, "--workload", "chat", "--num-images", "2", "--hf-batch-size", "4", "--check", "4",
         "--threads", "1", "--kv-cache-memory-bytes", str(8 * 1024**2), "--rate-sizes", "128"]
    )  # fmt: skip
    assert res["tokens_identical"] == "4/4"
    # Qwen2/2.5-VL have a FLOP model (each image's tower from its own grid): the floor is reported.
    assert res["model"] == "Qwen2_5_VLForConditionalGeneration" and res["floor_tflops"] > 0
    assert res["compute_floor_fraction"] > 0 and res["hf_compute_floor_fraction"] > 0
    assert res["engine_encoded_images"] == 2 and res["engine_cached_prompt_tokens"] > 0
