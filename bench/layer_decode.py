"""A decoder layer's parts in one C call (`layer_decode`, models/layers/layer_decode.py) against the
same engine without it, side by side in one run: the decode step at each batch size, per weight
setting, and whether the greedy tokens are equal (they must be: the same kernels on the same rows).

    python -m bench.layer_decode [--models bench-qwen3.5,bench-qwen2.5-vl] [--settings fp32,int8,int4]
                                 [--batch-sizes 1,8] [--json bench/results/layer_decode.json]

Both engines of a pair run the cpu backend with every kernel the measured table enables on this
CPU, one of them without `layer_decode`; the steps are timed in rounds, the two engines in turns
(ABBA), and each figure is the median of the rounds' medians.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from bench import vlm
from bench.machine import machine_info
from bench.roofline import step_seconds
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.kernels import cpu_build
from mm_engine.kernels.cpu_kernels import MEASURED_FASTER
from mm_engine.testing.common import WORDS


def pair(path: str, setting: str, seats: int) -> dict[str, LLM]:
    """The engine with and without the one-call parts (`on`, `off`), warmed up."""
    measured = MEASURED_FASTER[cpu_build.best_variant()]
    kind, _, head = setting.partition("+")
    engines = {}
    for name, kernels in (("on", measured | {"layer_decode"}), ("off", measured - {"layer_decode"})):
        engines[name] = LLM(path, attention_backend="cpu", cpu_kernels=",".join(sorted(kernels)),
                            quantization=None if kind == "fp32" else kind, quantize_lm_head=head == "head",
                            max_num_seqs=seats, kv_cache_memory_bytes=768 * 1024**2,
                            num_state_snapshots=0)  # fmt: skip
        step_seconds(engines[name], 1, 16, 4, seed=99)
    return engines


def same_tokens(engines: dict[str, LLM]) -> bool:
    rng = random.Random(5)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(30 + 9 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {k: [r.outputs[0].token_ids for r in e.generate(prompts, params)] for k, e in engines.items()}
    return outs["on"] == outs["off"]


def cell(step: dict) -> str:
    return f"{step['off_ms']:9.2f} / {step['on_ms']:7.2f} ({step['speedup']:4.2f}x)".rjust(28)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bench-qwen3.5,bench-qwen2.5-vl")
    ap.add_argument("--settings", default="fp32,int8,int4")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for model in args.models.split(","):
        path = vlm.resolve_model(model)
        for setting in args.settings.split(","):
            engines = pair(path, setting, max(batches))
            times: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in engines}
            for r in range(args.rounds):
                for b in batches:
                    for name in ("off", "on", "on", "off"):
                        t = step_seconds(engines[name], b, args.context, args.steps, seed=r)
                        times[name][b].append(statistics.median(t))
            row = {"model": model, "setting": setting, "tokens_equal": same_tokens(engines), "steps": {}}
            for b in batches:
                off, on = (statistics.median(times[k][b]) * 1e3 for k in ("off", "on"))
                row["steps"][b] = {"off_ms": off, "on_ms": on, "speedup": off / on}
            rows.append(row)
            for llm in engines.values():
                llm.close()
    print(f"{machine_info()['cpu']}, {torch.get_num_threads()} threads, variant {cpu_build.best_variant()}")
    cells = " ".join(f"{f'b={b} ms without / with':>28}" for b in batches)
    print(f"{'model':18} {'setting':8} {cells} {'tokens':>7}")
    for r in rows:
        cells = " ".join(cell(s) for s in r["steps"].values())
        print(f"{r['model']:18} {r['setting']:8} {cells} {'equal' if r['tokens_equal'] else 'DIFFER':>7}")
    result = {"machine": machine_info(), "variant": cpu_build.best_variant(), "args": vars(args)}
    result["rows"] = rows
    if args.json:
        save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
