"""Host time of one decode step, split by phase, at batch 1 to 256: in-process and split.

    python -m bench.host_overhead [--batches 1,8,32,128,256] [--steps 30] [--device cpu]
                                  [--json bench/results/host_overhead.json]

The model is a random LLaVA whose language model is so small (hidden 64, one layer) that the
forward costs little next to what the host does around it. For each batch size, that many text
requests decode together (their prompts are prefilled first, outside the measurement). Each step
is split into: scheduling (`Scheduler.schedule`), input preparation (`ModelRunner.prepare`: ids,
positions, block tables, slot mapping to the device), forward, sampling, the core's output
(appending tokens, finishing), the frontend's output (detokenizing, stop strings, building
outputs: `OutputProcessor.process`) and IPC (encoding that step's outputs as the engine-core
process sends them, decoding them as the frontend does).

Two totals come from the same steps: `in_process_ms`, what one thread does per step when the
core runs in the caller's process (everything but IPC), and `core_ms`, the engine-core process's
critical path when it runs on its own (core phases plus encoding), the frontend's share
(`frontend_ms`: decoding plus output processing) then running beside it in the other process.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.core import messages as m
from mm_engine.models.platform import environment
from mm_engine.testing import build_checkpoint

TINY_LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2)  # fmt: skip
PHASES = ("schedule", "prepare", "forward", "sample", "core_output", "frontend_output", "encode", "decode")


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
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.requests.values()):
        engine.step()  # prefill (and the first tokens): not measured
    timers: dict[str, float] = defaultdict(float)
    core = engine.core
    _timed(core.scheduler, "schedule", timers, "schedule", sync)
    _timed(core.runner, "prepare", timers, "prepare", sync)
    _timed(core.runner, "forward", timers, "forward", sync)
    _timed(core.sampler, "sample_tensor", timers, "sample", sync)
    _timed(engine.frontend.output, "process", timers, "frontend_output", sync)
    core_total = 0.0
    step = core.step

    def core_step():
        nonlocal core_total
        start = time.perf_counter()
        outs = step()
        sync()
        core_total += time.perf_counter() - start
        start = time.perf_counter()  # what the engine-core process sends, and the frontend reads
        data = m.encode(m.Outputs(outs, core.stats(), 0.0))
        timers["encode"] += time.perf_counter() - start
        start = time.perf_counter()
        m.decode_from_core(data)
        timers["decode"] += time.perf_counter() - start
        return outs

    core.step = core_step
    for _ in range(steps):
        engine.step()
    timers["core_output"] = core_total - sum(timers[k] for k in ("schedule", "prepare", "forward", "sample"))
    ms = {k: round(timers[k] / steps * 1e3, 4) for k in PHASES}
    in_process = sum(v for k, v in ms.items() if k not in ("encode", "decode"))
    core_ms = in_process - ms["frontend_output"] + ms["encode"]
    return {"batch": batch, **ms, "in_process_ms": round(in_process, 4), "core_ms": round(core_ms, 4),
            "frontend_ms": round(ms["frontend_output"] + ms["decode"], 4),
            "host_share_in_process": round(1 - ms["forward"] / in_process, 3),
            "host_share_core": round(1 - ms["forward"] / core_ms, 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_checkpoint("llava", Path(tmp) / "tiny", text_dims=TINY_LM))
        rows = [measure(model, int(b), args.steps, args.device) for b in args.batches.split(",")]
    info = {**machine_info(), "cpu_variant": environment()["variant"], "device": args.device}
    print(f"decode step on {info.get('gpu') or info['cpu']} ({info['cpu_variant']}), ms per step")
    cols = (*PHASES, "in_process_ms", "core_ms", "frontend_ms")
    print("| batch | " + " | ".join(cols) + " |\n|---:|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    if args.json:
        result = {"machine": info, "steps": args.steps, "rows": rows}
        save_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
