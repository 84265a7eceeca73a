"""The engine's CPU defaults against its plain torch path, per ISA variant, side by side.

    python -m bench.cpu_paths [--variants avx512,avx2] [--workloads caption,chat] [--num-images 16]
                              [--json bench/results/cpu_paths.json]

For each variant: bench.offline's inputs run by the engine with its defaults (the C kernels of
that variant where measured faster), then with `cpu_packed_weights=False, attention_backend=
"torch"` (plain nn.Linear and torch attention), then the defaults again (A-B-A: drift cancels in
the mean). Every run is a fresh process with torch held to the variant's ISA (bench.kernels_cpu's
TORCH_ISA), so the avx2 rows of an AVX-512 machine are AVX2 against AVX2. The tokens of both
paths are compared request by request (random weights: a summation order can flip a near-tie,
so a difference is reported, not fatal).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench import vlm
from bench.kernels_cpu import TORCH_ISA
from bench.machine import machine_info
from bench.offline import workload_requests
from bench.offline_runs import Job, engine_run, run_in_child
from bench.save import save_json

PLAIN = {"cpu_packed_weights": False, "attention_backend": "torch"}
ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 2 * 1024**3}


def run_held(variant: str, job: Job) -> dict:
    """`engine_run(job)` in a fresh process whose torch and kernels are held to `variant`."""
    env = {**TORCH_ISA[variant], "MM_ENGINE_CPU_VARIANT": variant}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the spawned child reads them as torch starts
    try:
        return run_in_child(engine_run, job)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare_paths(variant: str, workload: str, num_images: int, threads: int, model: str) -> dict:
    requests = workload_requests(workload, num_images, 0)
    job = Job(model, threads, num_images, 0, requests, ENGINE)
    plain_job = Job(model, threads, num_images, 0, requests, {**ENGINE, **PLAIN})
    first = run_held(variant, job)
    print(f"  {variant} {workload}: defaults {first['seconds']:.1f} s", flush=True)
    plain = run_held(variant, plain_job)
    print(f"  {variant} {workload}: plain torch {plain['seconds']:.1f} s", flush=True)
    again = run_held(variant, job)
    print(f"  {variant} {workload}: defaults again {again['seconds']:.1f} s", flush=True)
    defaults = (first["seconds"] + again["seconds"]) / 2
    same = sum(a == b for a, b in zip(first["tokens"], plain["tokens"], strict=True))
    return {
        "variant": variant,
        "workload": workload,
        "num_images": num_images,
        "num_requests": len(requests),
        "output_tokens": sum(n for _, _, n in requests),
        "defaults_seconds": defaults,
        "defaults_seconds_runs": [first["seconds"], again["seconds"]],
        "plain_torch_seconds": plain["seconds"],
        "speedup": plain["seconds"] / defaults,
        "matmul_gflops_per_s": {
            "defaults": [sum(r["matmul_flops_per_s"]) / 2e9 for r in (first, again)],
            "plain_torch": sum(plain["matmul_flops_per_s"]) / 2e9,
        },
        "tokens_identical": f"{same}/{len(requests)}",
    }


def print_table(results: dict) -> None:
    print(f"\n### bench.cpu_paths ({results['machine']['cpu']}, {results['threads']} threads, float32)\n")
    print(
        "| variant | workload | defaults (s) | plain torch path (s) | defaults speedup | tokens identical |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in results["rows"]:
        print(
            f"| {r['variant']} | {r['workload']} ({r['num_images']} images, {r['num_requests']} requests) | "
            f"{r['defaults_seconds']:.1f} | {r['plain_torch_seconds']:.1f} | {r['speedup']:.2f}x | "
            f"{r['tokens_identical']} |"
        )


def main(argv: list[str] | None = None) -> dict:
    from mm_engine.kernels import cpu_build

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=None, help="default: avx512 and avx2, where this CPU runs them")
    ap.add_argument("--workloads", default="caption,chat")
    ap.add_argument("--num-images", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", default=None, help="a LLaVA checkpoint (default: bench.vlm's, built once)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    names = (
        args.variants.split(",")
        if args.variants
        else [v for v in ("avx512", "avx2") if cpu_build.supported(v)]
    )
    model = args.model or str(vlm.bench_model_path())
    rows = [
        compare_paths(variant, workload, args.num_images, args.threads, model)
        for variant in names
        for workload in args.workloads.split(",")
    ]
    results = {"rows": rows, "threads": args.threads, "machine": machine_info()}
    print_table(results)
    if args.json:
        save_json(args.json, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
