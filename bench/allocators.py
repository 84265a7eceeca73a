"""jemalloc against glibc malloc, with and without the engine's own malloc tuning
(pools/cpu_memory.py), on the same offline job side by side: each run a fresh process, the
four settings in turn, `--rounds` times (so drift spreads over all of them).

    python -m bench.allocators [--num-images 32] [--rounds 2] [--json bench/results/allocators.json]
    python -m bench.allocators --serve [--num-prompts 24] [--json bench/results/allocators_serve.json]

`--serve`: the same four settings on `bench.serve` instead (a server per setting, started with
the allocator in its environment; `--no-cpu-tune-malloc` for the untuned ones), one replay each.

jemalloc comes in as the container's entrypoint brings it (LD_PRELOAD, and its MALLOC_CONF);
under jemalloc the engine's tuning (glibc's mallopt) has nothing to tune, so it is measured both
ways as a check. Reported: mean seconds, images/s and peak RSS per setting, and each against
glibc with the tuning (what `mm-engine` runs by default).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from pathlib import Path

import torch

from bench import vlm
from bench.machine import machine_info
from bench.offline import workload_requests
from bench.offline_runs import Job, engine_run, run_in_child
from bench.save import save_json

ROOT = Path(__file__).resolve().parents[1]
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def jemalloc_conf() -> str:
    """The MALLOC_CONF docker/entrypoint.sh sets (one place for it)."""
    text = (ROOT / "docker" / "entrypoint.sh").read_text()
    return re.search(r'JEMALLOC_CONF_DEFAULT="([^"]+)"', text).group(1)


SETTINGS = {  # name -> (environment, cpu_tune_malloc)
    "glibc_tuned": ({}, True),
    "glibc": ({}, False),
    "jemalloc": ({"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": None}, False),
    "jemalloc_tuned": ({"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": None}, True),
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-images", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve", action="store_true", help="measure on bench.serve instead")
    ap.add_argument("--num-prompts", type=int, default=24, help="with --serve")
    args = ap.parse_args(argv)
    if not Path(JEMALLOC).exists():
        raise SystemExit(f"no {JEMALLOC}: apt-get install libjemalloc2")
    if args.serve:
        return serve(args)
    model = vlm.resolve_model(args.model)
    requests = workload_requests("caption", args.num_images, 0, vlm.prompts_for(model))
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with _restored_env():
        for _ in range(args.rounds):
            for name, (env, tuned) in SETTINGS.items():
                _set_allocator(env)
                engine_args = {"cpu_tune_malloc": tuned, "kv_cache_memory_bytes": 1024**3}
                job = Job(model, args.threads, args.num_images, 0, requests, engine_args, rate_sizes=(512,))
                run = run_in_child(engine_run, job)
                runs[name].append({"seconds": run["seconds"], "peak_rss_mib": run["peak_rss_mib"]})
                print(f"  {name}: {run['seconds']:.1f} s", flush=True)
    rows = {}
    for name, rs in runs.items():
        seconds = sum(r["seconds"] for r in rs) / len(rs)
        rows[name] = {"seconds": seconds, "seconds_runs": [r["seconds"] for r in rs],
                      "images_per_s": args.num_images / seconds,
                      "peak_rss_mib": max(r["peak_rss_mib"] for r in rs)}  # fmt: skip
    base = rows["glibc_tuned"]["seconds"]
    for row in rows.values():
        row["speed_vs_glibc_tuned"] = base / row["seconds"]
    result = {"num_images": args.num_images, "rounds": args.rounds, "malloc_conf": jemalloc_conf(),
              "rows": rows, "machine": machine_info()}  # fmt: skip
    m = result["machine"]
    where = f"{m['date']}, {m['cpu']}, {args.threads} threads"
    print(f"\n### bench.allocators: caption, {args.num_images} images ({where})\n")
    print("| allocator | seconds (mean) | images/s | peak RSS (MiB) | vs glibc tuned |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']:.2f} | {r['images_per_s']:.2f} | {r['peak_rss_mib']:.0f} | "
              f"{r['speed_vs_glibc_tuned']:.3f}x |")  # fmt: skip
    if args.json is not None:
        save_json(args.json, result)
    return result


def serve(args: argparse.Namespace) -> dict:
    from bench import serve as bench_serve

    sargs = bench_serve.parse_args(["--num-prompts", str(args.num_prompts), "--request-rate", "inf",
                                    "--max-concurrency", "8", "--max-output-tokens", "64"])  # fmt: skip
    if args.model:
        sargs.model = args.model
    trace, n_images = bench_serve.make_trace(sargs)
    pngs = bench_serve.png_bytes(n_images, sargs.seed)
    keys = ("request_throughput", "output_throughput", "median_ttft_ms", "median_itl_ms", "p99_itl_ms")
    rows = {}
    with _restored_env():
        for name, (env, tuned) in SETTINGS.items():
            _set_allocator(env)
            sargs.server_args = "" if tuned else "--no-cpu-tune-malloc"
            metrics = bench_serve.run_once(sargs, trace, pngs, n_images)["metrics"]["overall"]
            rows[name] = {k: metrics.get(k) for k in keys}
    base = rows["glibc_tuned"]["output_throughput"]
    for row in rows.values():
        row["throughput_vs_glibc_tuned"] = row["output_throughput"] / base
    result = {"serve": True, "num_prompts": args.num_prompts, "malloc_conf": jemalloc_conf(), "rows": rows,
              "machine": machine_info()}  # fmt: skip
    m = result["machine"]
    print(f"\n### bench.allocators --serve: {args.num_prompts} requests ({m['date']}, {m['cpu']})\n")
    print(
        "| allocator | output tok/s | req/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | vs glibc tuned |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} | "
              f"{r['median_ttft_ms']:.0f} | {r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | "
              f"{r['throughput_vs_glibc_tuned']:.3f}x |")  # fmt: skip
    if args.json is not None:
        save_json(args.json, result)
    return result


def _set_allocator(env: dict) -> None:
    """This process's environment as the next child (engine run or server) should start with."""
    for key in ("LD_PRELOAD", "MALLOC_CONF"):
        os.environ.pop(key, None)
    for key, value in env.items():
        os.environ[key] = value if value is not None else jemalloc_conf()


@contextlib.contextmanager
def _restored_env():
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "MALLOC_CONF")}
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


if __name__ == "__main__":
    main()
