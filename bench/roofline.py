"""Decode step time against this machine's roofline, at batch sizes 1 to 64.

    python -m bench.roofline [--batch-sizes 1,2,4,8,16,32,64] [--context 256] [--json PATH]

For each batch size, that many text requests with `--context`-token prompts are prefilled, then
`--steps` decode steps of the engine are timed (`LLMEngine.step()` whole: scheduling, forward,
sampling, detokenization). The bound of one step is the larger of
  memory:  (weights of the decoder and head + every sequence's KV) bytes / measured read bandwidth
  compute: the step's FLOPs / measured fp32 matmul rate
and the figure of merit is bound / measured time. Both rates are measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from bench import vlm
from bench.machine import LlavaFlops, machine_info, matmul_flops_per_s, memory_bytes_per_s
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.testing.common import WORDS


def step_seconds(llm: LLM, batch: int, context: int, steps: int, seed: int) -> list[float]:
    """Time `steps` decode steps of `batch` sequences whose prompts are `context` tokens."""
    engine = llm.engine
    seats = engine.core.scheduler.max_num_seqs  # a hybrid model's state slots may set fewer
    if batch > seats:
        raise SystemExit(
            f"batch {batch} is more than the {seats} sequences the engine seats: raise its memory"
        )
    rng = random.Random(seed)
    # Long enough that nobody finishes while the last prompts are being prefilled (every running
    # request decodes a token in each of those steps); all are aborted after the timed steps.
    prefill_steps = -(-batch * (context + 1) // engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8 + 2 * prefill_steps, ignore_eos=True)
    ids = []
    for _ in range(batch):  # distinct prompts: nothing shared through the prefix cache
        ids.append(engine.add_request(" ".join(rng.choice(WORDS) for _ in range(context)), params))
    while any(r in engine.core.requests and not engine.core.requests[r].output_token_ids for r in ids):
        engine.step()
    engine.step()  # one decode step to settle
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for r in ids:
        engine.abort(r)
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size (median)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--model", default=None, help="a LLaVA checkpoint (default: bench.vlm's, built once)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    model = args.model or str(vlm.bench_model_path())
    peak, bandwidth = matmul_flops_per_s(), memory_bytes_per_s()
    print(f"fp32 matmul {peak / 1e9:.1f} GFLOP/s, read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    flops = LlavaFlops.from_config(AutoConfig.from_pretrained(model))
    llm = LLM(
        model,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=max(2048, args.context + 1),
        kv_cache_memory_bytes=max(sizes) * (args.context + args.steps + 32) * flops.kv_bytes_per_token * 2,
        enable_prefix_caching=False,
    )
    step_seconds(llm, 1, 16, 2, args.seed)  # warm-up
    rows = []
    for b in sizes:
        med = statistics.median(step_seconds(llm, b, args.context, args.steps, args.seed + b))
        f, nbytes = flops.decode_step(b, args.context + 1 + args.steps // 2)
        mem_s, compute_s = nbytes / bandwidth, f / peak
        bound = max(mem_s, compute_s)
        rows.append(
            {
                "batch": b,
                "step_ms": med * 1e3,
                "tokens_per_s": b / med,
                "memory_bound_ms": mem_s * 1e3,
                "compute_bound_ms": compute_s * 1e3,
                "bound": "memory" if mem_s >= compute_s else "compute",
                "fraction_of_roofline": bound / med,
            }
        )
        print(f"  batch {b:3d}: {med * 1e3:8.1f} ms/step", flush=True)
    leaked = {n: p.num_used for n, p in llm.engine.core.blocks.pools.items()}
    result = {
        "context": args.context,
        "matmul_gflops_per_s": peak / 1e9,
        "read_gb_per_s": bandwidth / 1e9,
        "weight_mib": flops.lm_weight_bytes / 2**20,
        "rows": rows,
        "blocks_held_after": leaked,
        "machine": machine_info(),
    }
    print_table(result)
    if args.json:
        save_json(args.json, result)
    return result


def print_table(r: dict) -> None:
    m = r["machine"]
    print(
        f"\n### bench.roofline: decode steps, {r['context']}-token contexts ({m['date']}, {m['cpu']}, "
        f"{m['torch_threads']} threads; fp32 matmul {r['matmul_gflops_per_s']:.0f} GFLOP/s, "
        f"read {r['read_gb_per_s']:.1f} GB/s, weights {r['weight_mib']:.0f} MiB)\n"
    )
    print(
        "| batch | step (ms) | tokens/s | memory bound (ms) | compute bound (ms) | bound by | of roofline |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|")
    for x in r["rows"]:
        print(
            f"| {x['batch']} | {x['step_ms']:.1f} | {x['tokens_per_s']:.1f} | {x['memory_bound_ms']:.1f} | "
            f"{x['compute_bound_ms']:.1f} | {x['bound']} | {x['fraction_of_roofline']:.1%} |"
        )


if __name__ == "__main__":
    main()
