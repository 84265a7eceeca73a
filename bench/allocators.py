"""jemalloc against glibc malloc, with and without the engine's own malloc tuning
(mm_engine/cpu_memory.py), on the same offline job side by side: each run a fresh process, the
four settings in turn, `--rounds` times (so drift spreads over all of them).

    python -m bench.allocators [--num-images 32] [--rounds 2] [--json bench/results/allocators.json]

jemalloc comes in as the container's entrypoint brings it (LD_PRELOAD, and its MALLOC_CONF);
under jemalloc the engine's tuning (glibc's mallopt) has nothing to tune, so it is measured both
ways as a check. Reported: mean seconds, images/s and peak RSS per setting, and each against
glibc with the tuning (what `mm-engine` runs by default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch

from bench import vlm
from bench.machine import machine_info
from bench.offline import workload_requests
from bench.offline_runs import Job, engine_run, run_in_child

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
    args = ap.parse_args(argv)
    if not Path(JEMALLOC).exists():
        raise SystemExit(f"no {JEMALLOC}: apt-get install libjemalloc2")
    model = vlm.resolve_model(args.model)
    requests = workload_requests("caption", args.num_images, 0, vlm.prompts_for(model))
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "MALLOC_CONF")}
    try:
        for _ in range(args.rounds):
            for name, (env, tuned) in SETTINGS.items():
                for key in ("LD_PRELOAD", "MALLOC_CONF"):
                    os.environ.pop(key, None)
                for key, value in env.items():
                    os.environ[key] = value if value is not None else jemalloc_conf()
                engine_args = {"cpu_tune_malloc": tuned, "kv_cache_memory_bytes": 1024**3}
                job = Job(model, args.threads, args.num_images, 0, requests, engine_args, rate_sizes=(512,))
                run = run_in_child(engine_run, job)
                runs[name].append({"seconds": run["seconds"], "peak_rss_mib": run["peak_rss_mib"]})
                print(f"  {name}: {run['seconds']:.1f} s", flush=True)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
