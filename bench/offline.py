"""Offline throughput, side by side: mm-engine against transformers on the same model and inputs.

    python -m bench.offline --workload caption|chat|video|ocr [--num-images N] [--json PATH] [--profile]
                            [--device cuda [--dtype float16]] [--json-schema SCHEMA.json]

Workloads (random-weight benchmark model from bench.vlm; output lengths seeded, long-tailed):
  caption  one captioning prompt per image (64 by default); outputs mean ~30 tokens, at most 64.
  chat     four questions per image (16 images, 64 requests by default); outputs mean ~100
           tokens, at most 384.
  video    one captioning prompt per clip (16 by default; a family that reads video, by default
           the Qwen2.5-VL benchmark model): each clip 8 frames at 2 fps, given to both sides as
           sampled frames; outputs as caption's.
  ocr      one transcription prompt per document page (1240 x 1754 px; by default on the
           LightOnOCR-shaped benchmark model); outputs as caption's.

transformers runs `LlavaForConditionalGeneration.generate`, greedy, batched with left padding, at
the batch size that gave it the best throughput in a small sweep run first (one batch per
candidate). Both sides run in fresh processes with the same thread count, in the order engine,
transformers, engine (A-B-A); the engine's figure is the mean of its two runs.

Figures: images/s and output tokens/s of both and their ratio, peak RSS of both, and the fraction
of the compute floor: the FLOPs the job needs (bench.machine; for chat the image and the shared
prompt prefix count once per image, since that is all the work the job requires) divided by wall
time x this machine's fp32 matmul rate. That rate is measured inside each run's process just
before and just after its timed job, and each run is held to the mean of its own two (the
machine's speed drifts by 15-40% over minutes here); the rate measured once at the start is kept
in the JSON as `matmul_gflops_per_s`. A sample of requests is checked to produce the same greedy
tokens on both sides.

With `--device cuda` both sides run on the GPU at `--dtype` (float16 by default there), the rate is
cuBLAS's at that dtype, and peak GPU memory is reported next to RSS. Half precision can flip a
random model's near-tied greedy tokens between two correct implementations, so there the token
check is reported but fails the run only in float32.

With `--json-schema` the run is the engine against itself instead: the job unconstrained and with
every output constrained to the schema, side by side (bench.offline_structured).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from bench import vlm
from bench.machine import LlavaFlops, machine_info, matmul_flops_per_s, qwen_tower_flops
from bench.offline_runs import Job, engine_run, hf_run, run_in_child
from bench.offline_structured import print_structured, structured_cost
from bench.save import save_json
from mm_engine.config import QUANTIZATIONS

DEFAULT_MODELS = {"video": "bench-qwen2.5-vl", "ocr": "bench-lighton-ocr"}  # else bench.vlm's LLaVA
HF_SWEEP = {"caption": (4, 8, 16, 32), "chat": (4, 8, 16)}  # chat at 32 lost to 8 and costs 90 s
HF_SWEEP_GPU = {"caption": (8, 16, 32, 64, 128), "chat": (8, 16, 32, 64, 128)}


def workload_requests(
    workload: str, num_images: int, seed: int, prompts=(vlm.CAPTION_PROMPT, vlm.chat_prompt)
) -> list[tuple[int, str, int]]:
    """(image index, prompt, output tokens) in submission order; `prompts`: the model's (caption
    prompt, question -> chat prompt), from `vlm.prompts_for`."""
    caption, chat = prompts
    if workload in ("caption", "video", "ocr"):
        lengths = vlm.output_lengths(num_images, "caption", seed)
        return [(i, caption, n) for i, n in enumerate(lengths)]
    lengths = vlm.output_lengths(4 * num_images, "chat", seed)
    return [
        (i, chat(q), lengths[4 * i + k]) for i in range(num_images) for k, q in enumerate(vlm.CHAT_QUESTIONS)
    ]


def floor_flops(
    flops: LlavaFlops, requests, prompt_ids: list[list[int]], vision: list[float] | None = None
) -> float:
    """The least work for the job: each image encoded once, each image's shared prompt prefix
    prefilled once, then every request's own tokens. `vision`: each image's tower FLOPs, where
    they depend on the image (else `flops.vision_per_image`)."""
    total = 0.0
    first_of: dict[int, list[int]] = {}
    for (image, _, n_out), ids in zip(requests, prompt_ids, strict=True):
        if image not in first_of:
            first_of[image] = ids
            total += flops.request(len(ids), n_out, images=0) + (
                flops.vision_per_image if vision is None else vision[image]
            )
        else:
            shared = _common_prefix(first_of[image], ids)
            total += flops.request(len(ids), n_out, cached=min(shared, len(ids) - 1), images=0)
    return total


def image_grids(model: str, job: Job) -> list[tuple[int, int, int]]:
    """Each benchmark image's patch grid, as the checkpoint's processor makes it."""
    from transformers import AutoConfig, AutoTokenizer

    from mm_engine.models import make_processing

    config = AutoConfig.from_pretrained(model)
    processing = make_processing(Path(model), AutoTokenizer.from_pretrained(model), config)
    return [processing.process(image).grid for image in vlm.images(job.num_images, job.seed)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def sweep_hf(job: Job, workload: str) -> tuple[int, dict[int, float]]:
    """One batch per candidate size, on the first requests of the workload; best images/s wins."""
    rates = {}
    for bs in (HF_SWEEP if job.device == "cpu" else HF_SWEEP_GPU)[workload]:
        per_batch = bs if workload == "caption" else max(1, bs // 4)  # chat: 4 requests per image
        if per_batch > job.num_images:
            break
        sub = [r for r in job.requests if r[0] < per_batch][:bs]
        # (no rate measurement: only the ranking of the sizes counts here)
        trial = Job(**{**job.__dict__, "requests": sub, "hf_batch_size": bs, "rate_sizes": ()})
        res = run_in_child(hf_run, trial)
        rates[bs] = per_batch / res["seconds"]
        print(f"  transformers sweep: batch {bs:3d} -> {rates[bs]:.2f} images/s", flush=True)
    return max(rates, key=rates.get), rates


def compare(engine_tokens, hf_tokens, sample: int) -> tuple[int, int]:
    """(identical, compared) over an evenly spread sample of requests."""
    idx = sorted({round(k * (len(engine_tokens) - 1) / max(1, sample - 1)) for k in range(sample)})
    return sum(engine_tokens[i] == hf_tokens[i] for i in idx), len(idx)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["caption", "chat", "video", "ocr"], default="caption")
    ap.add_argument(
        "--num-images", type=int, default=None, help="default: 64 for caption, 16 for chat (64 requests)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--hf-batch-size", type=int, default=None, help="skip the sweep and use this size")
    ap.add_argument("--check", type=int, default=8, help="requests whose tokens are compared")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=2 * 1024**3)
    ap.add_argument("--profile", action="store_true", help="time the engine's phases (scheduling, ...)")
    ap.add_argument("--multiprocess", action="store_true",
                    help="the engine core in a process of its own (LLM(multiprocess=True))")  # fmt: skip
    ap.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                    help="overlap step N+1 with step N (auto: on with CUDA; off with --profile)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--model", default=None, help="a checkpoint folder of any supported family, or one "
                    f"of bench.vlm's models, built once: {', '.join(vlm.MODEL_ALIASES)}")  # fmt: skip
    ap.add_argument(
        "--rate-sizes",
        default=None,
        help="square matmul sizes the rate is measured at (default 1024,2048,3072; 4096,8192 on a GPU)",
    )
    ap.add_argument("--json-schema", type=Path, default=None,
                    help="measure structured output's cost: free against constrained to this JSON schema "
                    "(default model then: bench-bytelevel)")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where both contestants run")
    ap.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="default: float32 on CPU, float16 on a GPU",
    )
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="the engine's LM linears rounded to this on load (engine only)")  # fmt: skip
    ap.add_argument("--vision-dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="the engine's tower in this dtype (engine only; default: --dtype)")  # fmt: skip
    args = ap.parse_args(argv)
    gpu = args.device != "cpu"
    dtype = args.dtype or ("float16" if gpu else "float32")
    rate_sizes = tuple(
        int(n) for n in (args.rate_sizes or ("4096,8192" if gpu else "1024,2048,3072")).split(",")
    )
    if args.num_images is None:  # chat at 64 images: ~15 minutes of transformers alone
        args.num_images = 64 if args.workload == "caption" else 16
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    schema = None if args.json_schema is None else json.loads(args.json_schema.read_text())
    video, ocr = args.workload == "video", args.workload == "ocr"
    default = "bench-bytelevel" if schema is not None else DEFAULT_MODELS.get(args.workload)
    model = vlm.resolve_model(args.model or default)
    prompts = vlm.prompts_for(model)
    if video or ocr:
        prompts = (vlm.video_prompt_for(model) if video else prompts[1]("transcribe this page"), prompts[1])
    requests = workload_requests(args.workload, args.num_images, args.seed, prompts)
    engine_args = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
    }
    if args.profile:  # the phases of the plain loop: with overlap they run at the same time
        if args.async_scheduling == "on":
            ap.error("--profile times the phases of the plain loop: not with --async-scheduling on")
        args.async_scheduling = "off"
    engine_args["async_scheduling"] = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    for name in ("quantization", "vision_dtype"):  # the engine's side only: transformers runs as is
        if getattr(args, name) is not None:
            engine_args[name] = getattr(args, name)
            print(f"mm-engine {name}: {engine_args[name]}", flush=True)
    if args.multiprocess:
        if args.profile:
            ap.error("--profile times the in-process engine's phases: not with --multiprocess")
        engine_args["multiprocess"] = True
    job = Job(
        model, args.threads, args.num_images, args.seed, requests, engine_args, profile=args.profile,
        rate_sizes=rate_sizes, device=args.device, dtype=dtype, video=video, pages=ocr,
    )  # fmt: skip
    if schema is not None:
        result = structured_cost(job, schema)
        print_structured(result)
        if args.json:
            save_json(args.json, result)
        if result["json_schema_valid"] != result["json_schema_completed"]:
            raise SystemExit("a completed constrained output does not validate against the schema")
        return result
    started = time.perf_counter()
    peak = matmul_flops_per_s(rate_sizes, device=args.device, dtype=getattr(torch, dtype))
    print(f"{dtype} matmul rate: {peak / 1e9:.1f} GFLOP/s ({args.device})", flush=True)
    ours = run_in_child(engine_run, job)
    print(f"  mm-engine: {ours['seconds']:.1f} s", flush=True)
    if args.hf_batch_size is None:
        best, sweep = sweep_hf(job, "caption" if video or ocr else args.workload)
    else:
        best, sweep = args.hf_batch_size, {}
    hf = run_in_child(hf_run, Job(**{**job.__dict__, "hf_batch_size": best, "profile": False}))
    print(f"  transformers (batch {best}): {hf['seconds']:.1f} s", flush=True)
    # The engine again after transformers (A-B-A): on a shared machine drift between the runs
    # cancels in the mean instead of landing on one side of the ratio.
    again = run_in_child(engine_run, Job(**{**job.__dict__, "profile": False}))
    print(f"  mm-engine again: {again['seconds']:.1f} s", flush=True)
    engine_runs = [ours["seconds"], again["seconds"]]
    ours["seconds"] = sum(engine_runs) / 2
    engine_rates = [sum(r["matmul_flops_per_s"]) / 2 for r in (ours, again)]
    hf_rate = sum(hf["matmul_flops_per_s"]) / 2
    same, compared = compare(ours["tokens"], hf["tokens"], args.check)
    config = AutoConfig.from_pretrained(model)
    # FLOP models: LLaVA's (fixed image tokens) and Qwen2/2.5-VL's (each image's own grid); other
    # families report no floor yet.
    floor = None
    if config.model_type == "llava":
        floor = floor_flops(LlavaFlops.from_config(config), requests, ours["prompt_ids"])
    elif config.model_type in ("qwen2_vl", "qwen2_5_vl") and not video:
        vision = [qwen_tower_flops(config.vision_config, grid) for grid in image_grids(model, job)]
        lm = LlavaFlops.language_model(config.text_config)
        floor = floor_flops(lm, requests, ours["prompt_ids"], vision)
    # Each run against the rate measured next to it; the engine's is the mean of its two runs.
    fractions = [floor / (t * r) if floor else None for t, r in zip(engine_runs, engine_rates, strict=True)]
    out_tokens = sum(n for _, _, n in requests)
    result = {
        "workload": args.workload,
        "engine_core": "process" if args.multiprocess else "in-process",  # RSS: this process only
        "async_scheduling": args.async_scheduling,
        "num_images": args.num_images,
        "num_requests": len(requests),
        "output_tokens": out_tokens,
        "engine_images_per_s": args.num_images / ours["seconds"],
        "hf_images_per_s": args.num_images / hf["seconds"],
        "engine_output_tokens_per_s": out_tokens / ours["seconds"],
        "hf_output_tokens_per_s": out_tokens / hf["seconds"],
        "throughput_ratio": hf["seconds"] / ours["seconds"],
        "compute_floor_fraction": sum(fractions) / 2 if floor else None,
        "hf_compute_floor_fraction": floor / (hf["seconds"] * hf_rate) if floor else None,
        "compute_floor_fraction_at_start_rate": floor / (ours["seconds"] * peak) if floor else None,
        "floor_tflops": floor / 1e12 if floor else None,
        "model": config.architectures[0] if config.architectures else config.model_type,
        "matmul_gflops_per_s": peak / 1e9,
        "engine_run_matmul_gflops_per_s": [r / 1e9 for r in engine_rates],
        "hf_run_matmul_gflops_per_s": hf_rate / 1e9,
        "engine_peak_rss_mib": ours["peak_rss_mib"],
        "hf_peak_rss_mib": hf["peak_rss_mib"],
        **(
            {"engine_peak_gpu_mib": ours["peak_gpu_mib"], "hf_peak_gpu_mib": hf["peak_gpu_mib"]}
            if gpu
            else {}
        ),
        "device": args.device,
        "dtype": dtype,
        "engine_seconds": ours["seconds"],
        "engine_seconds_runs": engine_runs,
        "hf_seconds": hf["seconds"],
        "hf_batch_size": best,
        "hf_sweep_images_per_s": sweep,
        "engine_cached_prompt_tokens": ours["cached_tokens"],
        "engine_encoded_images": ours["encoded_images"],
        "tokens_identical": f"{same}/{compared}",
        "engine_args": engine_args,
        "machine": machine_info(),
        "wall_s": time.perf_counter() - started,
    }
    if "profile" in ours:  # shares of the first engine run
        result["profile_shares"] = {k: v / engine_runs[0] for k, v in ours["profile"].items()}
    print_table(result)
    if args.json:
        save_json(args.json, result)
    if same != compared and dtype == "float32":
        raise SystemExit(f"token mismatch: only {same}/{compared} sampled requests are identical")
    return result


def print_table(r: dict) -> None:
    m, gpu = r["machine"], "engine_peak_gpu_mib" in r
    where = (
        f"{m['gpu']}, {r['dtype']}"
        if gpu
        else f"{m['cpu']}, {m['torch_threads']} threads, {r.get('dtype', 'float32')}"
    )
    print(
        f"\n### bench.offline `{r['workload']}` on {r.get('model', 'LLaVA')}: {r['num_images']} images, "
        f"{r['num_requests']} requests, "
        f"{r['output_tokens']} output tokens ({m['date']}, {where}, "
        f"matmul {r['matmul_gflops_per_s']:.0f} GFLOP/s)\n"
    )
    gpu_head, gpu_rule = (" peak GPU (MiB) |", "---:|") if gpu else ("", "")
    print(f"| | images/s | output tokens/s | compute-floor fraction | peak RSS (MiB) |{gpu_head}")
    print(f"|---|---:|---:|---:|---:|{gpu_rule}")
    for name, side in (("mm-engine", "engine"), (f"transformers (batch {r['hf_batch_size']})", "hf")):
        floor = r["compute_floor_fraction" if side == "engine" else "hf_compute_floor_fraction"]
        gpu_cell = f" {r[f'{side}_peak_gpu_mib']:.0f} |" if gpu else ""
        print(
            f"| {name} | {r[f'{side}_images_per_s']:.2f} | {r[f'{side}_output_tokens_per_s']:.1f} | "
            f"{'n/a' if floor is None else f'{floor:.1%}'} | {r[f'{side}_peak_rss_mib']:.0f} |{gpu_cell}"
        )
    print(f"| ratio | {r['throughput_ratio']:.2f}x | {r['throughput_ratio']:.2f}x | | |{' |' if gpu else ''}")
    if "engine_run_matmul_gflops_per_s" in r and r["compute_floor_fraction"] is not None:
        rates = ", ".join(f"{g:.0f}" for g in r["engine_run_matmul_gflops_per_s"])
        print(
            f"\nmatmul rate next to each run (GFLOP/s): mm-engine {rates}; transformers "
            f"{r['hf_run_matmul_gflops_per_s']:.0f}. At the start-of-run rate alone the engine's "
            f"floor fraction reads {r['compute_floor_fraction_at_start_rate']:.1%}."
        )
    print(f"\ntokens identical on sampled requests: {r['tokens_identical']}")
    if "profile_shares" in r:
        shares = ", ".join(
            f"{k} {v:.1%}" for k, v in sorted(r["profile_shares"].items(), key=lambda kv: -kv[1])
        )
        print(f"mm-engine time shares: {shares}")


if __name__ == "__main__":
    main()
