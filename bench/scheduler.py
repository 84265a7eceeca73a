"""How long one `Scheduler.schedule()` takes as the waiting queue grows.

    python -m bench.scheduler [--waiting 100,1000,5000,10000] [--running 256] [--steps 300]
                              [--json bench/results/scheduler.json]

No model: the real scheduler, block manager, prefix cache and encoder cache, with a fake runner
that advances computed tokens and appends a token per sampled request (as the engine does). A
batch of `--running` requests is decoding (the seats are full) while `--waiting` requests, 40%
with an image, priorities 0-2, arrive spread over the last 20 s, so aging and image-first both
matter and most of the queue cannot be admitted. Requests that finish are replaced by waiting
ones, and new arrivals keep the queue at its length. Printed: p50, p99 and max of `schedule()`
in milliseconds per queue length; the goal is p99 <= 2 ms at 10,000 waiting and 256 running.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.save import save_json
from mm_engine.models.platform import environment
from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.request import ImageSpan, Request
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import make_policy
from mm_engine.sched.scheduler import Scheduler
from mm_engine.vision.encoder_cache import EncoderCache

BS, IMG_TOKENS, IMG_ID = 16, 64, 99


class Workload:
    def __init__(self, waiting: int, running: int, seed: int, policy: str) -> None:
        self.rng = random.Random(seed)
        self.seq = 0
        n_text, n_image = running * 12 + 64, running * 6 + 64
        blocks = BlockManager(BlockPool(TEXT, 0, n_text), BlockPool(IMAGE, n_text, n_image), BS, True, 0.01)
        self.encoder_cache = EncoderCache(1 << 40)
        self.sched = Scheduler(
            blocks,
            make_policy(policy),
            max_num_seqs=running,
            max_num_batched_tokens=max(2048, running * 2),
            encoder_cache=self.encoder_cache,
            encoder_budget=4096,
            max_waiting_requests=waiting * 2 + running,
        )
        self.now = 1000.0
        for _ in range(running + waiting):
            self.arrive(self.now - self.rng.uniform(0, 20))
        self.target = waiting

    def arrive(self, when: float) -> None:
        rng, seq = self.rng, self.seq
        self.seq += 1
        ids: list[int] = [1]
        spans = []
        if rng.random() < 0.4:
            key = f"img{rng.randrange(50)}"
            spans.append(ImageSpan(1, IMG_TOKENS, torch.zeros(1), key))
            ids += [IMG_ID] * IMG_TOKENS
        ids += [rng.randrange(2, 90) for _ in range(rng.randrange(8, 48))]
        params = SamplingParams(max_tokens=rng.randrange(16, 96))
        req = Request(str(seq), ids, spans, params, when, seq, frozenset(), priority=rng.randrange(3))
        self.sched.add(req)

    def step(self) -> float:
        start = time.perf_counter()
        batch = self.sched.schedule(self.now)
        seconds = time.perf_counter() - start
        for req, n in batch.items:  # the fake runner
            for span in req.images:
                self.encoder_cache.put(span.content_hash, torch.zeros(1))
            req.num_computed_tokens += n
            self.sched.blocks.commit(req)
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(5)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    self.sched.finish(req)
        while len(self.sched.waiting) < self.target:
            self.arrive(self.now)
        self.now += 0.02
        return seconds


def measure(waiting: int, running: int, steps: int, seed: int, policy: str) -> dict:
    w = Workload(waiting, running, seed, policy)
    for _ in range(20):  # fill the batch: prefills first, then decodes
        w.step()
    times = sorted(w.step() * 1e3 for _ in range(steps))
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {
        "waiting": waiting,
        "running": len(w.sched.running),
        "p50_ms": round(pick(0.5), 4),
        "p99_ms": round(pick(0.99), 4),
        "max_ms": round(times[-1], 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scheduler", description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", default="100,1000,5000,10000")
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--policy", default="priority", choices=["priority", "fcfs"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.waiting.split(",")]
    rows = [measure(n, args.running, args.steps, args.seed, args.policy) for n in lengths]
    info = {**machine_info(), "cpu_variant": environment()["variant"]}
    print(f"schedule() on {info['cpu']}, {info['cpu_variant']} ({args.policy} policy, {args.running} seats)")
    print("| waiting | running | p50 ms | p99 ms | max ms |\n|---:|---:|---:|---:|---:|")
    for r in rows:
        ms = " | ".join(f"{r[k]:.3f}" for k in ("p50_ms", "p99_ms", "max_ms"))
        print(f"| {r['waiting']} | {r['running']} | {ms} |")
    if args.json:
        result = {"machine": info, "policy": args.policy, "steps": args.steps, "rows": rows}
        save_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
