"""Batch captioning end to end on a tiny random checkpoint: a folder of 100+ images of mixed sizes
and formats with broken files among them, kill and resume, shards, manifests, bounded memory and
the command's exit statuses. Every caption is compared with `LLM.generate` run on the image alone."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.jobs.caption import Captioner, caption_images
from mm_engine.jobs.caption_cli import main
from mm_engine.jobs.caption_inputs import CaptionInput

REPO = Path(__file__).resolve().parents[2]
CLI = "import sys; from mm_engine.jobs.caption_cli import main; sys.exit(main())"
PROMPT = "USER: <image> describe this picture ASSISTANT:"
MAX_TOKENS = 6
KV = 8 * 1024**2
ENGINE = {"kv_cache_memory_bytes": KV, "max_num_seqs": 8}  # 105 images: the batch refills many times
FORMATS = [("PNG", ".png"), ("JPEG", ".jpg"), ("WEBP", ".webp"), ("GIF", ".gif"), ("BMP", ".bmp")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The tiny model's matmuls gain nothing from a second thread, and the job's decode workers want
    # the other core: two torch threads on a shared 2-core machine mostly wait for each other.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[str, list[str], list[str]]:
    """105 good images in nested folders, one more without an extension, and 3 broken files."""
    root = tmp_path_factory.mktemp("caption") / "images"
    rng = random.Random(0)
    good = []
    for i in range(105):
        fmt, ext = FORMATS[i % len(FORMATS)]
        path = root / ["", "a", "a/b", "c"][i % 4] / f"img{i:03d}{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        make_image(i, (rng.randint(8, 160), rng.randint(8, 160))).save(path, fmt)
        good.append(path)
    good.append(root / "c" / "scan_0001")  # an image by its content alone: it must be captioned
    make_image(999, (50, 40)).save(good[-1], "PNG")
    jpeg = io.BytesIO()
    make_image(1000, (64, 64)).save(jpeg, "JPEG")
    broken = [root / "a" / "truncated.jpg", root / "random.png", root / "a" / "b" / "notes.jpeg"]
    broken[0].write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    broken[1].write_bytes(rng.randbytes(300))
    broken[2].write_text("a text file with an image extension\n")
    (root / "README.txt").write_text("no image extension, no image inside: not an input\n")
    return str(root), [p.as_posix() for p in good], [p.as_posix() for p in broken]


@pytest.fixture(scope="module")
def reference(clip_llama, folder) -> dict[str, dict]:
    """What each good image's line must be: `LLM.generate` on that image alone."""
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    ref = {}
    for path in folder[1]:
        out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": Path(path).read_bytes()}}, GREEDY)
        c = out[0].outputs[0]
        ref[path] = {
            "id": path,
            "image": path,
            "prompt": PROMPT,
            "caption": c.text,
            "finish_reason": c.finish_reason,
            "prompt_tokens": len(out[0].prompt_token_ids),
            "completion_tokens": len(c.token_ids),
        }
    return ref


def _args(inputs: list[str], out: Path, model: str, *extra: str) -> list[str]:
    common = ["--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--kv-cache-memory-bytes", str(KV)]
    return [*inputs, "--out", str(out), "--model", model, *common, "--progress", "none", *extra]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(clip_llama, folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "results.jsonl"
    summary = caption_images(
        folder[0],
        out,
        model=clip_llama,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        workers=3,
        progress="none",
        **ENGINE,
    )
    return summary, {r["id"]: r for r in _records(out)}, len(_records(out))


def test_folder_every_image_captioned_once_as_alone_broken_files_error(folder, reference, full_run):
    root, good, broken = folder
    summary, by_id, n_lines = full_run
    assert n_lines == len(by_id) == len(good) + len(broken)  # one line per input, no repeats
    for path in good:
        assert by_id[path] == reference[path]
    for path in broken:
        rec = by_id[path]
        assert set(rec) == {"id", "image", "error"} and "not a decodable image" in rec["error"]
        assert root not in rec["error"]  # errors never carry paths
    assert (summary.inputs, summary.captioned, summary.failed, summary.skipped) == (109, 106, 3, 0)
    assert summary.generated_tokens == sum(r["completion_tokens"] for r in reference.values())
    assert summary.prompt_tokens == sum(r["prompt_tokens"] for r in reference.values())
    assert summary.images_per_second > 0 and summary.tokens_per_second > 0
    assert summary.wall_time_s >= summary.load_time_s > 0
    # Some captions stop early, others run to max_tokens: with max_num_seqs=8 for 109 inputs, requests
    # finished at different steps and new ones took their places.
    assert {"stop", "length"} <= {r["finish_reason"] for r in reference.values()}


@pytest.mark.slow
@pytest.mark.subprocess
def test_killed_job_resumes_to_every_input_exactly_once(clip_llama, folder, full_run, tmp_path, capsys):
    out, log = tmp_path / "results.jsonl", tmp_path / "stderr.txt"
    args = _args([folder[0]], out, clip_llama)
    # One request at a time, so that the job is surely killed partway.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLI, *args, "--max-num-seqs", "1"], cwd=REPO, env=env, stderr=err
        )
    try:
        deadline = time.monotonic() + 300  # only against a hang
        while not out.exists() or out.read_bytes().count(b"\n") < 5:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no results from the job"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    done = out.read_bytes().count(b"\n")
    assert 5 <= done < 109

    assert main([*args, "--resume"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["skipped"], summary["captioned"] + summary["failed"]) == (done, 109 - done)
    records = _records(out)
    assert len(records) == 109 and {r["id"]: r for r in records} == full_run[1]


def test_two_shards_cover_every_input_once(clip_llama, folder, full_run, tmp_path, capsys):
    shards = []
    for i in range(2):
        out = tmp_path / f"shard{i}.jsonl"
        assert main(_args([folder[0]], out, clip_llama, "--shard", f"{i}/2", "--max-num-seqs", "16")) == 0
        shards.append(_records(out))
    ids = [[r["id"] for r in shard] for shard in shards]
    assert all(ids) and set(ids[0]).isdisjoint(ids[1])
    assert sorted(ids[0] + ids[1]) == sorted(full_run[1])
    assert {r["id"]: r for r in shards[0] + shards[1]} == full_run[1]
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["inputs"] for s in summaries] == [len(x) for x in ids]


def _data_url(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def test_manifest_prompts_chat_template_errors_and_log_lines(clip_llama, folder, tmp_path, capsys):
    a, b = folder[1][0], folder[1][1]
    manifest = tmp_path / "list.jsonl"
    lines = [
        json.dumps({"image": a, "id": "first"}),  # the job's prompt
        json.dumps({"image": a, "prompt": "what color is the circle"}),  # a question: chat template
        json.dumps({"image": b, "prompt": "USER: <image> how many ASSISTANT:"}),  # a raw prompt
        json.dumps({"image": "missing.png"}),  # read next to the manifest: not there
        "{broken json",
    ]
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"
    log = {"progress": "log", "log_interval": 0}  # a line per result
    summary = caption_images(
        manifest, out, model=clip_llama, prompt=PROMPT, max_tokens=MAX_TOKENS, kv_cache_memory_bytes=KV, **log
    )
    by_id = {r["id"]: r for r in _records(out)}
    assert (summary.captioned, summary.failed) == (3, 2) and len(by_id) == 5

    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    raw = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": Path(a).read_bytes()}}, GREEDY)[0]
    image_part = {"type": "image_url", "image_url": {"url": _data_url(a)}}
    question = [image_part, {"type": "text", "text": "what color is the circle"}]
    chat = llm.chat([{"role": "user", "content": question}], GREEDY)[0]
    raw_b = llm.generate(
        {"prompt": "USER: <image> how many ASSISTANT:", "multi_modal_data": {"image": Path(b).read_bytes()}},
        GREEDY,
    )[0]
    assert by_id["first"]["caption"] == raw.outputs[0].text and by_id["first"]["prompt"] == PROMPT
    assert by_id[a]["prompt"] == "what color is the circle"  # the second line for `a`: its path as id
    assert by_id[a]["caption"] == chat.outputs[0].text
    assert by_id[a]["prompt_tokens"] == len(chat.prompt_token_ids)
    assert by_id[b]["caption"] == raw_b.outputs[0].text
    assert by_id["missing.png"] == {
        "id": "missing.png",
        "image": "missing.png",
        "error": "input could not be read",
    }
    assert "not valid JSON" in by_id[f"{manifest}:5"]["error"]
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("caption: ")]
    assert len(progress) == 5 and progress[-1].startswith("caption: 5/5 inputs (100%), 2 failed")


def test_captioner_streams_with_bounded_lookahead(clip_llama, folder, reference):
    """The Python building block (also the Ray Data recipe's): images as bytes, a lazy iterator that
    is never read more than `max_in_flight + prefetch` inputs ahead of the results."""
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=2)
    captioner = Captioner(llm, PROMPT, GREEDY, workers=2, max_in_flight=4, prefetch=3)
    paths = folder[1][:30]
    taken = 0
    most_in_engine = 0

    def lazy():
        nonlocal taken, most_in_engine
        for p in paths:
            taken += 1
            most_in_engine = max(most_in_engine, len(llm.engine.core.requests))
            yield CaptionInput(p, p, data=Path(p).read_bytes())

    results = 0
    for rec in captioner.run(lazy()):
        results += 1
        assert taken - results <= 4 + 3
        assert rec == reference[rec["id"]]
    assert results == 30 and most_in_engine == 4  # the engine was kept full, and no fuller
    assert not llm.engine.core.requests and not llm.engine.has_unfinished()


def test_a_full_engine_queue_is_waited_out_and_prompts_are_checked(clip_llama, folder, reference):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=1, max_waiting_requests=1)
    captioner = Captioner(llm, PROMPT, GREEDY, max_in_flight=4)  # more than the engine will queue
    paths = folder[1][:6]
    records = list(captioner.run(CaptionInput(p, p, p) for p in paths))
    assert sorted(r["id"] for r in records) == sorted(paths) and all(r == reference[r["id"]] for r in records)
    llm.engine.inputs.chat_template = None
    with pytest.raises(ValueError, match="no chat template: the prompt must contain <image>"):
        Captioner(llm, "describe this")


def test_exit_status_and_an_existing_output(clip_llama, folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    two = folder[1][:2]
    assert main(_args(two, out, clip_llama)) == 0  # a job with good images
    first = out.read_text()
    assert main(_args([*two, folder[2][0]], out, clip_llama)) == 2  # results would be mixed up
    assert "already exists" in capsys.readouterr().err and out.read_text() == first
    # Resuming a finished job needs no model at all.
    assert main(_args(two, out, str(tmp_path / "nowhere"), "--resume")) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 2
    # A model that cannot load: the job cannot run, and --overwrite has destroyed nothing yet.
    (tmp_path / "empty").mkdir()
    assert main(_args(two, out, str(tmp_path / "empty"), "--overwrite")) == 2
    assert "config.json" in capsys.readouterr().err and out.read_text() == first
    # Broken images are not a failure of the job.
    assert main(_args([*two, *folder[2]], out, clip_llama, "--overwrite")) == 0
    assert json.loads(capsys.readouterr().out)["failed"] == 3 and len(_records(out)) == 5
    assert main(_args([str(tmp_path / "missing")], tmp_path / "x.jsonl", clip_llama)) == 2
    bad_prompt = ["--prompt", "USER: <image> <image> two ASSISTANT:"]
    assert main(_args(two, tmp_path / "y.jsonl", clip_llama, *bad_prompt)) == 2
    assert "exactly one image placeholder" in capsys.readouterr().err
