"""Online serving benchmark: `mm-engine serve` under a replayed arrival trace, measured over HTTP.

    python -m bench.serve [--num-prompts 40] [--request-rate 0.5] [--burstiness 1.0]
                          [--max-concurrency 8] [--caption-fraction 0.5] [--shared-image-fraction 0.3]
                          [--goodput ttft:5000 tpot:250] [--json bench/results/serve.json]

Starts `mm-engine serve` on 127.0.0.1 with the benchmark model (`bench.vlm`, random weights), waits
for `/health`, sends one warm-up request per route, then replays a seeded trace: arrivals with
gamma-distributed gaps (shape `--burstiness`, 1.0 = Poisson) at `--request-rate` req/s (`inf`: all
at once), at most `--max-concurrency` in flight. A `--caption-fraction` of the requests are
streamed multipart uploads to `/v1/caption`, the rest streamed `/v1/chat/completions` requests with
the image as a base64 data URL; a `--shared-image-fraction` reuse an image sent before, so the
encoder and prefix caches have something to hit. Every request sets `max_tokens` from
`bench.vlm.output_lengths` (capped at `--max-output-tokens`); chat also sets `ignore_eos`.

`--peer-url URL` replays the same trace against another OpenAI-compatible server already running on
the same checkpoint (vLLM's `vllm serve`, say), ABBA with mm-engine, chat requests only.

Printed: a markdown table of the `vllm bench serve` metrics (TTFT, TPOT, ITL, E2EL: mean, median,
percentiles; request, output-token and total-token throughput; goodput under `--goodput` SLOs),
overall and per modality; see `bench.serve_metrics` for the definitions. `--json PATH` writes them.
The server is stopped (SIGTERM) at the end, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from bench.machine import machine_info
from bench.save import save_json
from bench.serve_compare import compare
from bench.serve_metrics import RequestRecord, compute_metrics, markdown_table, parse_goodput
from bench.serve_process import running_server
from bench.vlm import CHAT_QUESTIONS, images, output_lengths


@dataclass(slots=True)
class TraceItem:
    arrival: float  # seconds after the start of the replay
    modality: str  # "caption" or "chat"
    image: int  # index into the trace's images
    max_tokens: int
    question: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=0.5, help="req/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument(
        "--max-concurrency", "--concurrency", type=int, default=8, help="requests in flight at most"
    )
    p.add_argument(
        "--compare-engine-core",
        action="store_true",
        help="replay the trace four times, `--engine-core thread` (the core in the "
        "server's process) and `process` (its own) in ABBA order, and compare them",
    )
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                   help="two sets of extra server flags (e.g. '--no-decode-first' ''): the trace "
                   "four times, A B B A, compared")  # fmt: skip
    p.add_argument("--peer-url", default=None,
                   help="an OpenAI-compatible server already running on the same checkpoint (e.g. `vllm "
                   "serve`): the trace four times, mm-engine, peer, peer, mm-engine, compared; chat "
                   "requests only (use --caption-fraction 0: /v1/caption is ours)")  # fmt: skip
    p.add_argument("--peer-name", default="peer", help="the peer's label in the tables and JSON")
    p.add_argument("--caption-fraction", type=float, default=0.5)
    p.add_argument("--shared-image-fraction", type=float, default=0.3)
    p.add_argument("--max-output-tokens", type=int, default=128, help="cap on the drawn output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=["ttft:5000", "tpot:250"],
                   help="SLOs as NAME:MS, NAME in ttft, tpot, e2el (vllm's syntax)")  # fmt: skip
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, besides the median")
    p.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    p.add_argument(
        "--model", default=None, help="checkpoint folder, or bench (default) / bench-qwen2.5-vl (bench.vlm's)"
    )
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--server-args", default="", help="extra `mm-engine serve` flags, one string")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", action="store_true")
    args = p.parse_args(argv)
    args.slos = parse_goodput(args.goodput)
    args.percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    if args.request_rate <= 0 or args.burstiness <= 0 or args.max_concurrency < 1 or args.num_prompts < 1:
        p.error("--request-rate, --burstiness, --max-concurrency and --num-prompts must be positive")
    return args


def make_trace(args: argparse.Namespace) -> tuple[list[TraceItem], int]:
    """The seeded trace and how many distinct images it uses."""
    rng = random.Random(f"serve-trace-{args.seed}")
    n = args.num_prompts
    if args.request_rate == float("inf"):
        gaps = np.zeros(n)
    else:  # mean gap 1/rate whatever the shape; shape < 1 clusters arrivals, > 1 evens them out
        scale = 1.0 / (args.request_rate * args.burstiness)
        gaps = np.random.default_rng(args.seed).gamma(args.burstiness, scale, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])  # the first request goes at once
    kinds = ["caption" if rng.random() < args.caption_fraction else "chat" for _ in range(n)]
    lengths = {k: iter(output_lengths(kinds.count(k), k, args.seed)) for k in ("caption", "chat")}
    trace, used = [], 0
    for t, kind in zip(arrivals, kinds, strict=True):
        shared = used > 0 and rng.random() < args.shared_image_fraction
        image = rng.randrange(used) if shared else used
        used += not shared
        max_tokens = min(args.max_output_tokens, next(lengths[kind]))
        trace.append(TraceItem(float(t), kind, image, max_tokens, rng.choice(CHAT_QUESTIONS)))
    return trace, used


def png_bytes(n: int, seed: int) -> list[bytes]:
    out = []
    for img in images(n, seed):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _request(item: TraceItem, image: bytes, model: str) -> dict:
    """httpx.stream keyword arguments for one trace item (both routes stream server-sent events)."""
    if item.modality == "caption":
        form = {"max_tokens": str(item.max_tokens), "temperature": "0", "stream": "true"}
        return {"url": "/v1/caption", "data": form, "files": {"image": ("image.png", image, "image/png")}}
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": item.question}]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": item.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return {"url": "/v1/chat/completions", "json": body}


def _chunk_fields(chunk: dict) -> tuple[str, str | None, dict | None]:
    """(new text, finish reason, usage) of a caption or chat chunk."""
    if chunk.get("object") == "caption.chunk":
        return chunk.get("text") or "", chunk.get("finish_reason"), chunk.get("usage")
    choices = chunk.get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return delta.get("content") or "", choices[0].get("finish_reason"), chunk.get("usage")


async def send(client: httpx.AsyncClient, item: TraceItem, image: bytes, model: str) -> RequestRecord:
    """Send one request and time its stream: TTFT and ITL count chunks that carry text."""
    rec = RequestRecord(item.modality)
    start = last = time.perf_counter()
    usage = None
    try:
        async with client.stream("POST", **_request(item, image, model)) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(line[6:])
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message')}"
                    return rec
                text, reason, chunk_usage = _chunk_fields(chunk)
                if text:
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                rec.finish_reason = reason or rec.finish_reason
                usage = chunk_usage or usage
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # a broken connection or stream
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.latency = time.perf_counter() - start
    if usage is None:
        rec.error = "the stream ended without usage"
        return rec
    rec.ttft = rec.ttft or rec.latency  # no text at all: the first token is the whole answer
    rec.prompt_tokens, rec.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    rec.success = True
    return rec


async def replay(
    url: str, trace: list[TraceItem], pngs: list[bytes], args: argparse.Namespace
) -> tuple[list[RequestRecord], float]:
    limits = httpx.Limits(max_connections=args.max_concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if not args.no_warmup:  # a fresh image, so the trace's first use of an image stays a miss
            warm = png_bytes(1, seed=args.seed + 1_000_003)[0]
            for kind in ("caption", "chat") if args.caption_fraction > 0 else ("chat",):
                rec = await send(client, TraceItem(0.0, kind, 0, 4, CHAT_QUESTIONS[0]), warm, model)
                if not rec.success:
                    raise RuntimeError(f"warm-up {kind} request failed: {rec.error}")
        gate = asyncio.Semaphore(args.max_concurrency)
        bar = tqdm(total=len(trace), desc="requests", unit="req")

        async def one(item: TraceItem) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + item.arrival - time.perf_counter()))
            async with gate:  # latency is timed from the send, not from the arrival (as vllm does)
                rec = await send(client, item, pngs[item.image], model)
            bar.update()
            return rec

        start = time.perf_counter()
        records = await asyncio.gather(*(one(item) for item in trace))
        duration = time.perf_counter() - start
        bar.close()
    return list(records), duration


def report(args: argparse.Namespace, trace: list[TraceItem], records: list[RequestRecord],
           duration: float, n_images: int) -> dict:  # fmt: skip
    groups = {"overall": records}
    for kind in ("caption", "chat"):
        groups[kind] = [r for r, item in zip(records, trace, strict=True) if item.modality == kind]
    metrics = {k: compute_metrics(v, duration, args.slos, args.percentiles) for k, v in groups.items()}
    finish = {k: dict(Counter(r.finish_reason for r in v if r.success)) for k, v in groups.items()}
    errors = dict(Counter(r.error for r in records if not r.success).most_common(5))
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in args.slos.items()) or "none"
    print(f"\n## bench.serve: {len(trace)} requests ({len(groups['caption'])} caption, "
          f"{len(groups['chat'])} chat, {n_images} distinct images), rate {args.request_rate:g} req/s, "
          f"burstiness {args.burstiness:g}, max concurrency {args.max_concurrency}\n")  # fmt: skip
    print(f"duration {duration:.1f} s; goodput SLOs: {slos}; finish reasons: {finish['overall']}\n")
    print(markdown_table(metrics, args.percentiles))
    if errors:
        print("\nfailures:", *(f"  {n} x {e}" for e, n in errors.items()), sep="\n")
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "args": flags,
        "duration_s": duration,
        "num_distinct_images": n_images,
        "finish_reasons": finish,
        "errors": errors,
        "metrics": metrics,
    }


def run_once(
    args: argparse.Namespace, trace: list[TraceItem], pngs: list[bytes], n_images: int,
    peer: str | None = None,
) -> dict:  # fmt: skip
    """One replay: against `mm-engine serve` started for it, or against `peer`, a running server."""
    if peer is not None:
        print(f"replaying {len(trace)} requests against {peer}", flush=True)
        records, duration = asyncio.run(replay(peer, trace, pngs, args))
        return report(args, trace, records, duration, n_images)
    with running_server(args) as url:
        print(f"server ready at {url}; replaying {len(trace)} requests", flush=True)
        records, duration = asyncio.run(replay(url, trace, pngs, args))
    return report(args, trace, records, duration, n_images)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM to the benchmark must still stop the server: make it unwind like an exception.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trace, n_images = make_trace(args)
    pngs = png_bytes(n_images, args.seed)
    base_flags = args.server_args
    configs = None
    if args.peer_url and args.caption_fraction > 0:
        print("bench.serve: error: --peer-url needs --caption-fraction 0 (the peer has no /v1/caption)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.peer_url:
        configs = {"mm-engine": "", args.peer_name: None}
    elif args.compare_engine_core:
        configs = {"thread": "--engine-core thread", "process": "--engine-core process"}
    elif args.compare:
        configs = {(flags.strip() or "default"): flags for flags in args.compare}
        if len(configs) != 2:
            print("bench.serve: error: --compare needs two different sets of flags", file=sys.stderr)
            return 2
    try:
        if configs:
            a, b = configs
            results: dict[str, list[dict]] = {a: [], b: []}
            for label in (a, b, b, a):  # ABBA: drift hits both alike
                if configs[label] is None:  # the peer, already running
                    results[label].append(run_once(args, trace, pngs, n_images, peer=args.peer_url))
                    continue
                args.server_args = f"{base_flags} {configs[label]}"
                results[label].append(run_once(args, trace, pngs, n_images))
            result = {
                "runs": results,
                "comparison": compare(results, a, b),
                "machine": results[a][0]["machine"],
            }
        else:
            result = run_once(args, trace, pngs, n_images)
    except RuntimeError as exc:  # the server failed, or a warm-up request did: no traceback
        print(f"bench.serve: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        save_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
