"""Replay one arrival trace through the engine under `fcfs` and `priority`, side by side.

    python -m bench.priority [--requests 160] [--load 1.2] [--out bench/results/priority.json]

The trace: Poisson arrivals at 1.2 times the request rate the engine sustains on this machine
(measured first, so that a queue forms), 60% image requests (a captioning question about a
picture) and 40% text-only, output lengths from a seeded long-tail distribution. The same trace
runs through two engines on the same random-weight checkpoint, arrivals replayed on the wall
clock, so the policy decides who waits. Printed: time to first token p50/p99 per modality, the
longest wait of any text request, and throughput.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.testing import build_checkpoint


def make_trace(n: int, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        is_image = rng.random() < 0.6
        out_len = min(64, max(1, int(rng.lognormvariate(2.6, 0.7))))  # median ~13, long tail
        words = " ".join(rng.choice(["what", "is", "this", "describe", "the", "picture"]) for _ in range(4))
        item = {"t": t, "max_tokens": out_len, "modality": "image" if is_image else "text"}
        if is_image:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            px = torch.randint(0, 256, (48, 64, 3), generator=g, dtype=torch.uint8).numpy()
            item["prompt"] = {
                "prompt": f"USER: <image> {words} ASSISTANT:",
                "multi_modal_data": {"image": Image.fromarray(px)},
            }
        else:
            item["prompt"] = f"USER: {words} ASSISTANT:"
        trace.append(item)
    return trace


def replay(llm: LLM, trace: list[dict]) -> dict:
    engine = llm.engine
    start = time.time()
    pending = list(trace)
    kind: dict[str, str] = {}
    done: dict[str, object] = {}
    while pending or engine.has_unfinished():
        now = time.time() - start
        while pending and pending[0]["t"] <= now:
            item = pending.pop(0)
            sp = SamplingParams(temperature=0, max_tokens=item["max_tokens"], ignore_eos=True)
            kind[engine.add_request(item["prompt"], sp)] = item["modality"]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished() and pending:
            time.sleep(max(0.0, pending[0]["t"] - (time.time() - start)))
    wall = time.time() - start
    stats: dict = {"wall_s": wall, "requests_per_s": len(done) / wall}
    stats["preemptions"] = engine.core.scheduler.num_preemptions
    stats["output_tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in done.values()) / wall
    for modality in ("image", "text"):
        ttft = [
            o.metrics.first_token_time - o.metrics.arrival_time
            for r, o in done.items()
            if kind[r] == modality
        ]
        wait = [
            o.metrics.first_scheduled_time - o.metrics.arrival_time
            for r, o in done.items()
            if kind[r] == modality
        ]
        stats[modality] = {
            "n": len(ttft),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "longest_wait_s": max(wait),
        }
    return stats


def _capacity(llm: LLM, seed: int) -> float:
    """Requests per second the engine completes on this trace's mix, all submitted at once."""
    items = make_trace(48, 1000.0, seed + 1)
    params = [SamplingParams(temperature=0, max_tokens=i["max_tokens"], ignore_eos=True) for i in items]
    start = time.time()
    llm.generate([i["prompt"] for i in items], params)
    return len(items) / (time.time() - start)


def _mean(runs: list[dict]) -> dict:
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _mean([r[key] for r in runs])
        else:
            out[key] = sum(r[key] for r in runs) / len(runs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument(
        "--rate", type=float, default=None, help="arrivals per second (default: --load x capacity)"
    )
    ap.add_argument("--load", type=float, default=1.2, help="arrival rate as a multiple of measured capacity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-wait-s", type=float, default=2.0)
    ap.add_argument("--out", default="bench/results/priority.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint("llava", Path(tmp) / "bench", image_size=64, patch_size=8, seed=args.seed)
        engines = {
            policy: LLM(
                str(path),
                scheduling_policy=policy,
                max_num_seqs=args.max_num_seqs,
                max_wait_s=args.max_wait_s,
                kv_cache_memory_bytes=64 * 1024**2,
                enable_prefix_caching=False,  # every image is new; keep the runs independent
            )
            for policy in ("fcfs", "priority")
        }
        rate = args.rate or args.load * _capacity(engines["fcfs"], args.seed)
        print(f"arrival rate {rate:.1f} requests/s")
        trace = make_trace(args.requests, rate, args.seed)
        runs: dict[str, list[dict]] = {"fcfs": [], "priority": []}
        # A B B A: on a shared machine the load drifts; alternating cancels a linear drift.
        for policy in ("fcfs", "priority", "priority", "fcfs"):
            runs[policy].append(replay(engines[policy], trace))
        results = {policy: _mean(r) for policy, r in runs.items()}
    rows = [
        ("TTFT p50 image (s)", "image", "ttft_p50_s"),
        ("TTFT p99 image (s)", "image", "ttft_p99_s"),
        ("TTFT p50 text (s)", "text", "ttft_p50_s"),
        ("TTFT p99 text (s)", "text", "ttft_p99_s"),
        ("longest text wait (s)", "text", "longest_wait_s"),
    ]
    print(f"{'metric':<26}{'fcfs':>10}{'priority':>10}{'ratio':>8}")
    for label, modality, key in rows:
        a, b = results["fcfs"][modality][key], results["priority"][modality][key]
        print(f"{label:<26}{a:>10.3f}{b:>10.3f}{b / a if a else float('nan'):>8.2f}")
    for key in ("requests_per_s", "output_tokens_per_s", "preemptions"):
        a, b = results["fcfs"][key], results["priority"][key]
        print(f"{key:<26}{a:>10.1f}{b:>10.1f}{b / a if a else float('nan'):>8.2f}")
    results["config"] = vars(args)
    save_json(Path(args.out), results)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
