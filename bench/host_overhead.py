"""Host time of one decode step, split by phase, at batch 1 to 256.

    python -m bench.host_overhead [--batches 1,8,32,128,256] [--steps 30] [--device cpu]
                                  [--json bench/results/host_overhead.json]

The model is a random LLaVA whose language model is so small (hidden 64, one layer) that the
forward costs little next to what the host does around it. For each batch size, that many text
requests decode together (their prompts are prefilled first, outside the measurement); each step's
wall time is split into scheduling (`Scheduler.schedule`), input preparation
(`ModelRunner.prepare`: token ids, positions, block tables, slot mapping to the device), forward,
sampling, and output processing (appending tokens, detokenizing, stop checks, building outputs:
the rest of `LLMEngine.step`). Printed: milliseconds per step in each phase and the host's share.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.machine import machine_info
from mm_engine import LLM, SamplingParams
from mm_engine.platform import environment
from mm_engine.testing import build_checkpoint

TINY_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2)  # fmt: skip
PHASES = ("schedule", "prepare", "forward", "sample", "output")


def _timed(obj, name: str, timers: dict, bucket: str, sync) -> None:
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            timers[bucket] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def measure(model: str, batch: int, steps: int, device: str) -> dict:
    llm = LLM(model, device=device, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
              kv_cache_memory_bytes=64 * 1024**2, max_model_len=512)  # fmt: skip
    engine = llm.engine
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.0)
    for k in range(batch):
        engine.add_request(f"USER: what is shape {k} ASSISTANT:", params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefill (and the first tokens): not measured
    timers: dict[str, float] = defaultdict(float)
    _timed(engine.scheduler, "schedule", timers, "schedule", sync)
    _timed(engine.runner, "prepare", timers, "prepare", sync)
    _timed(engine.runner, "forward", timers, "forward", sync)
    _timed(engine.sampler, "sample", timers, "sample", sync)
    total = 0.0
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        total += time.perf_counter() - start
    timers["output"] = total - sum(timers.values())
    per_step = {k: round(timers[k] / steps * 1e3, 4) for k in PHASES}
    host = sum(v for k, v in per_step.items() if k != "forward")
    return {"batch": batch, "step_ms": round(total / steps * 1e3, 4), **per_step,
            "host_ms": round(host, 4), "host_share": round(host / (total / steps * 1e3), 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_checkpoint(Path(tmp) / "tiny", text_dims=TINY_LM))
        rows = [measure(model, int(b), args.steps, args.device) for b in args.batches.split(",")]
    info = {**machine_info(), "cpu_variant": environment()["variant"], "device": args.device}
    print(f"decode step on {info.get('gpu') or info['cpu']} ({info['cpu_variant']}), ms per step")
    cols = ("step_ms", *PHASES, "host_share")
    print("| batch | " + " | ".join(cols) + " |\n|---:|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"machine": info, "steps": args.steps, "rows": rows}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
