"""Interactive latency with and without a Batch API batch in the background, on one trace.

    python -m bench.batch_background [--batch-lines 2000] [--batch-max-tokens 64]
                                     [bench.serve flags: --num-prompts, --request-rate, ...]
                                     [--json bench/results/batch_background.json]

Replays bench.serve's seeded trace four times (ABBA) against `mm-engine serve` on the benchmark
model: "alone", and "batch", where a file of `--batch-lines` captioning requests (chat, an image as
a data URL each) was uploaded and its batch is running before the trace starts (the runner's lines
at the background priority, `--batch-max-in-flight` at once). Printed: the interactive TTFT and ITL
(median, p99, max) and throughput of both, side by side, and how many batch lines finished during
the trace (the idle capacity the batch used). The batch is cancelled after each run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shlex
import sys
import tempfile
import time

import httpx

from bench.save import save_json
from bench.serve import make_trace, png_bytes, replay, report
from bench.serve import parse_args as serve_args
from bench.serve_compare import compare
from bench.serve_process import running_server
from bench.vlm import images


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.batch_background", add_help=False)
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--batch-images", type=int, default=64, help="distinct images the batch cycles through")
    ours, rest = p.parse_known_args(argv)
    return ours, serve_args(rest)


def batch_file(args: argparse.Namespace) -> bytes:
    urls = []
    for img in images(args.batch_images, seed=7_000_001):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    lines = []
    for i in range(args.batch_lines):
        content = [{"type": "image_url", "image_url": {"url": urls[i % len(urls)]}},
                   {"type": "text", "text": "Describe the image."}]  # fmt: skip
        body = {"messages": [{"role": "user", "content": content}], "temperature": 0,
                "max_tokens": args.batch_max_tokens, "ignore_eos": True}  # fmt: skip
        lines.append(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def start_batch(url: str, data: bytes) -> str:
    with httpx.Client(base_url=url, timeout=120) as client:
        f = client.post("/v1/files", files={"file": ("batch.jsonl", data)}, data={"purpose": "batch"}).json()
        body = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = client.post("/v1/batches", json=body).json()
        while batch["request_counts"]["completed"] < 1:  # running, past its first answers
            time.sleep(0.5)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        return batch["id"]


def batch_done(url: str, batch_id: str) -> int:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()["request_counts"]["completed"]


def run(label: str, bg: argparse.Namespace, args: argparse.Namespace, trace, pngs, n_images, data) -> dict:
    with tempfile.TemporaryDirectory(prefix="mm-engine-batches-") as folder:
        base = args.server_args
        args.server_args = f"{base} --batch-dir {shlex.quote(folder)}"
        try:
            with running_server(args) as url:
                batch_id = start_batch(url, data) if label == "batch" else None
                before = batch_done(url, batch_id) if batch_id else 0
                records, duration = asyncio.run(replay(url, trace, pngs, args))
                during = batch_done(url, batch_id) - before if batch_id else 0
                if batch_id:
                    httpx.post(f"{url}/v1/batches/{batch_id}/cancel", timeout=30)
        finally:
            args.server_args = base
    result = report(args, trace, records, duration, n_images)
    result["batch_lines_done_during_trace"] = during
    result["batch_lines_per_s"] = during / duration
    print(f"[{label}] batch lines answered during the trace: {during} ({during / duration:.2f}/s)")
    return result


def main(argv: list[str] | None = None) -> int:
    bg, args = parse_args(argv)
    trace, n_images = make_trace(args)
    pngs = png_bytes(n_images, args.seed)
    data = batch_file(bg)
    results: dict[str, list[dict]] = {"alone": [], "batch": []}
    for label in ("alone", "batch", "batch", "alone"):  # ABBA: drift hits both alike
        results[label].append(run(label, bg, args, trace, pngs, n_images, data))
    rows = compare(results, "alone", "batch")
    done = [r["batch_lines_done_during_trace"] for r in results["batch"]]
    print(f"\nbatch lines answered during the trace: {done} (of {bg.batch_lines})")
    if args.json:
        flags = {**vars(bg), **{k: v for k, v in vars(args).items() if k in ("num_prompts", "request_rate",
                 "max_concurrency", "caption_fraction", "server_args", "model", "seed")}}  # fmt: skip
        save_json(args.json, {"args": flags, "runs": results, "comparison": rows,
                              "machine": results["alone"][0]["machine"]})  # fmt: skip
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
