"""Tensor parallelism side by side: the same offline job at each `--sizes` TP degree, in fresh
processes, the machine's threads split evenly over the ranks (on a CPU the ranks share the cores:
TP=2 on 2 cores is two 1-thread ranks against one 2-thread engine).

    python -m bench.tensor_parallel [--sizes 1,2] [--encoder-modes data,rank0] [--workload caption]
                                    [--num-images 32] [--device cpu|cuda]
                                    [--json bench/results/tensor_parallel.json]

The default model is the benchmark model with 8 query / 4 KV heads (its 9 / 3 split by 3 only).
Each size above 1 runs once per `--encoder-modes` entry (`mm_encoder_tp_mode`: the vision tower
data-parallel over the ranks, or on rank 0 alone). Reported per run: seconds, images/s, output
tokens/s, the ratio to the first run, and whether its greedy tokens equal the first run's (they
must, in float32).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench import vlm
from bench.machine import machine_info
from bench.offline import workload_requests
from bench.offline_runs import Job, engine_run, run_in_child
from bench.save import save_json


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--encoder-modes", default="data,rank0", help="mm_encoder_tp_mode values, for TP > 1")
    ap.add_argument("--workload", choices=["caption", "chat"], default="caption")
    ap.add_argument("--num-images", type=int, default=32)
    ap.add_argument("--model", default="bench-even-heads", help="a checkpoint folder or a bench alias")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="in all, over the ranks")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1024**3, help="per rank")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    model = vlm.resolve_model(args.model)
    requests = workload_requests(args.workload, args.num_images, 0, vlm.prompts_for(model))
    dtype = "float16" if args.device != "cpu" else "float32"
    rows, first_tokens, started = [], None, time.perf_counter()
    runs = [(s, m) for s in sizes for m in (args.encoder_modes.split(",") if s > 1 else ["-"])]
    for size, mode in runs:
        engine_args = {"tensor_parallel_size": size, "kv_cache_memory_bytes": args.kv_cache_memory_bytes}
        if mode != "-":
            engine_args["mm_encoder_tp_mode"] = mode
        job = Job(model, max(1, args.threads // size), args.num_images, 0, requests, engine_args,
                  rate_sizes=(512,), device=args.device, dtype=dtype)  # fmt: skip
        run = run_in_child(engine_run, job)
        tokens = sum(len(t) for t in run["tokens"])
        first_tokens = first_tokens or run["tokens"]
        rows.append({
            "tensor_parallel_size": size, "mm_encoder_tp_mode": mode, "threads_per_rank": job.threads,
            "seconds": run["seconds"],
            "images_per_s": args.num_images / run["seconds"], "output_tokens_per_s": tokens / run["seconds"],
            "tokens_equal_first": run["tokens"] == first_tokens, "peak_rss_mib_rank0": run["peak_rss_mib"],
        })  # fmt: skip
        print(f"  TP={size} {mode}: {run['seconds']:.1f} s", flush=True)
    for r in rows:
        r["ratio_to_first"] = rows[0]["seconds"] / r["seconds"]
    result = {"workload": args.workload, "num_images": args.num_images, "device": args.device, "dtype": dtype,
              "rows": rows, "machine": machine_info(), "wall_s": time.perf_counter() - started}  # fmt: skip
    m = machine_info()
    where = m["gpu"] if args.device != "cpu" else f"{m['cpu']}, {args.threads} threads in all"
    print(f"\n### bench.tensor_parallel `{args.workload}`, {args.num_images} images ({m['date']}, {where})\n")
    print("| TP | tower | threads/rank | seconds | images/s | output tok/s | vs first | tokens equal |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['tensor_parallel_size']} | {r['mm_encoder_tp_mode']} | {r['threads_per_rank']} | "
              f"{r['seconds']:.1f} | "
              f"{r['images_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['ratio_to_first']:.2f}x | "
              f"{r['tokens_equal_first']} |")  # fmt: skip
    if args.json is not None:
        save_json(args.json, result)
    if dtype == "float32" and not all(r["tokens_equal_first"] for r in rows):
        raise SystemExit("a tensor-parallel size changed the greedy tokens")
    return result


if __name__ == "__main__":
    main()
