"""Async scheduling on and off, side by side: the same captioning batch through the engine with
the plain loop and with step N+1 prepared while step N computes (each launch mode asked for).

    python -m bench.async_scheduling [--model bench] [--workload caption|text] [--num-images 32]
                                     [--max-tokens 32] [--modes off,thread] [--rounds 2] [--device cpu]
                                     [--json bench/results/async_scheduling.json]

Runs alternate (off, thread, off, thread, ...) so drift on a shared machine lands on both sides;
each figure is the mean of its rounds. The tokens of every mode must equal the plain loop's
(greedy), which the table says. On CUDA the modes worth comparing are off and inline.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench import vlm
from bench.machine import machine_info
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.models.platform import environment


def _engine_args(mode: str, device: str, dtype: str) -> dict:
    args = dict(device=device, dtype=dtype, vision_dtype=dtype, max_num_seqs=256)
    if mode == "off":
        return args | dict(async_scheduling=False)
    return args | dict(async_scheduling=True, async_launch=mode)


def run_once(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint folder, or bench (bench.vlm's model)")
    ap.add_argument("--workload", choices=["caption", "text"], default="caption",
                    help="caption: one image per request; text: as many text-only prompts")  # fmt: skip
    ap.add_argument("--num-images", type=int, default=32, help="requests (one image each for caption)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="off,thread", help="off, inline, thread: comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    dtype = "float16" if args.device == "cuda" else "float32"
    model = vlm.resolve_model(args.model)
    caption, _ = vlm.prompts_for(model)

    def prompts(n: int, seed: int) -> list:
        if args.workload == "text":  # a varied opening: no prefix shared beyond the template
            return [f"Question {seed}-{i}: {'tell me more ' * (i % 5)}about the picture." for i in range(n)]
        return [{"prompt": caption, "multi_modal_data": {"image": [im]}} for im in vlm.images(n, seed)]

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {mode: LLM(model, **_engine_args(mode, args.device, dtype)) for mode in modes}
    for llm in engines.values():  # warm-up: first-call costs (allocations, kernel compiles)
        llm.generate(prompts(2, 999), SamplingParams(max_tokens=2))
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        batch = prompts(args.num_images, r)  # new images each round: no cache hits across rounds
        for mode in modes:
            s, toks = run_once(engines[mode], batch, params)
            seconds[mode].append(s)
            tokens.setdefault(mode, []).extend(toks)
    base = sum(seconds[modes[0]]) / args.rounds
    out_tokens = args.num_images * args.max_tokens
    rows = []
    for mode in modes:
        mean = sum(seconds[mode]) / args.rounds
        rows.append({
            "mode": mode, "seconds": mean, "runs": seconds[mode], "output_tokens_per_s": out_tokens / mean,
            "speedup_vs_first": base / mean, "tokens_equal_first": tokens[mode] == tokens[modes[0]],
        })  # fmt: skip
    print(f"{'mode':<8} {'seconds':>8} {'tok/s':>8} {'vs ' + modes[0]:>8}  same tokens")
    for r in rows:
        print(f"{r['mode']:<8} {r['seconds']:8.2f} {r['output_tokens_per_s']:8.1f} "
              f"{r['speedup_vs_first']:8.3f}  {r['tokens_equal_first']}")  # fmt: skip
    result = {
        "model": Path(model).name, "workload": args.workload, "device": args.device, "dtype": dtype,
        "num_images": args.num_images, "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows,
        "machine": machine_info(), "environment": environment(),
    }  # fmt: skip
    if args.json is not None:
        save_json(args.json, result)
    return 0 if all(r["tokens_equal_first"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
