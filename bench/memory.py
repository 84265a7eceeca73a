"""KV memory under a fixed budget: the pools' internal waste, and how many sequences fit at once
compared with transformers' static cache sized for the same maximum length.

    python -m bench.memory [--requests 96] [--kv-mib 256] [--block-size 16] [--drain] [--json PATH]

About 3 minutes on 2 CPU cores (one torch thread, see --threads).

Workload (random-weight benchmark model from bench.vlm, seeded, submitted all at once so that the
KV budget, not `max_num_seqs`, bounds the batch): caption requests (image + short prompt, caption
lengths), chat requests (image + question, chat lengths), text-only chat; image requests share
their pictures (several prompts per picture), so prefix reuse is in play. The policy is `fcfs`:
with everything queued at once, the default policy's aging would soon let waiting requests preempt
running ones, which measures the policy (and recompute time), not how tightly the pools pack.

After every engine step the benchmark reads the pools and the running requests' block tables:
- internal waste per pool: `1 - filled/allocated` slots, allocated = used blocks x block size,
  filled = slots holding computed KV (a block shared by several requests counts once). Reported as
  a time average (slot sums over the measured steps) and at the step of peak occupancy.
- sequences holding KV at once, mean and max while the queue is non-empty, against
  budget // (bytes of a batch-1 `transformers.StaticCache` for the longest prompt + longest output).
The run stops when the queue empties (the rest is aborted) unless `--drain`; then every block must
be free again (or merely cached for prefix reuse), else the exit status is 1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import StaticCache

from bench import vlm
from bench.machine import machine_info
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.pools.block_manager import IMAGE, TEXT

POOLS = (TEXT, IMAGE)


@dataclass(slots=True)
class Item:
    kind: str  # "caption", "chat" or "text"
    prompt: str | dict
    max_tokens: int


def make_workload(n: int, seed: int, uses_per_image: float = 2.0) -> list[Item]:
    """40% caption, 40% chat about a picture, 20% text-only chat, in a seeded random order."""
    rng = random.Random(f"memory-{seed}")
    kinds = ["caption"] * round(0.4 * n) + ["chat"] * round(0.4 * n)
    kinds += ["text"] * (n - len(kinds))
    rng.shuffle(kinds)
    n_img = sum(k != "text" for k in kinds)
    pictures = vlm.images(max(1, round(n_img / uses_per_image)), seed)
    caption_len = iter(vlm.output_lengths(n, "caption", seed))
    chat_len = iter(vlm.output_lengths(n, "chat", seed))
    items, k = [], 0
    for kind in kinds:
        question = rng.choice(vlm.CHAT_QUESTIONS)
        if kind == "text":
            items.append(Item(kind, f"USER: {question} ASSISTANT:", next(chat_len)))
            continue
        # Pictures are dealt round-robin over a shuffled order: repeats are spread out in time.
        image = pictures[k % len(pictures)]
        k += 1
        text = vlm.CAPTION_PROMPT if kind == "caption" else vlm.chat_prompt(question)
        length = next(caption_len if kind == "caption" else chat_len)
        items.append(Item(kind, {"prompt": text, "multi_modal_data": {"image": image}}, length))
    return items


def static_cache_bytes(text_config, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of transformers' StaticCache for one sequence of `max_len` tokens, allocated for real."""
    cache = StaticCache(config=text_config, max_cache_len=max_len)
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    # It allocates lazily on the first update; force it so the tensors can be measured.
    cache.early_initialization(1, text_config.num_key_value_heads, head_dim, dtype, torch.device("cpu"))
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _sample(engine) -> dict:
    """Allocated and filled slots per pool, from the pools and the running block tables."""
    bs = engine.core.blocks.block_size
    fill: dict[int, int] = {}
    for req in engine.core.scheduler.running:
        for i, block in enumerate(req.block_table):
            fill[block] = max(fill.get(block, 0), min(bs, max(0, req.num_computed_tokens - i * bs)))
    out = {"running": len(engine.core.scheduler.running), "waiting": len(engine.core.scheduler.waiting)}
    for name in POOLS:
        pool = engine.core.blocks.pools[name]
        mine = [n for b, n in fill.items() if b in pool]
        out[name] = {
            "used": pool.num_used,
            "allocated": pool.num_used * bs,
            "filled": sum(mine),
            "held": len(mine),  # blocks the running requests hold: must equal pool.num_used
            "used_frac": pool.num_used / pool.num_blocks if pool.num_blocks else 0.0,
        }
    return out


def _waste(samples: list[dict], pools: tuple[str, ...]) -> float:
    alloc = sum(s[p]["allocated"] for s in samples for p in pools)
    return 1.0 - sum(s[p]["filled"] for s in samples for p in pools) / alloc if alloc else 0.0


def run(llm: LLM, items: list[Item], drain: bool = False) -> dict:
    """Submit every item, step the engine, sample after each step; abort what is left at the end."""
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=i.max_tokens, ignore_eos=True) for i in items]
    ids = [engine.add_request(item.prompt, sp) for item, sp in zip(items, params, strict=True)]
    prompt_lens = [engine.core.requests[r].num_prompt_tokens for r in ids]
    samples, start = [], time.perf_counter()
    # Without --drain it stops when the queue empties: after that memory no longer binds, and the
    # long tail of decodes would take most of the time while telling nothing about packing.
    while engine.has_unfinished() and (drain or engine.core.scheduler.waiting):
        engine.step()
        samples.append(_sample(engine) | {"t": time.perf_counter() - start})
    for rid in list(engine.core.requests):
        engine.abort(rid)
    wall = time.perf_counter() - start
    queued = [s for s in samples if s["waiting"]] or samples  # KV-bound: someone waits for blocks
    peak = max(samples, key=lambda s: sum(s[p]["allocated"] for p in POOLS))
    waste = {p: _waste(samples, (p,)) for p in POOLS} | {"overall": _waste(samples, POOLS)}
    return {
        "steps": len(samples),
        "queued_steps": len(queued),
        "wall_s": wall,
        "prompt_lens": prompt_lens,
        "kv_waste": waste,
        "kv_waste_at_peak": {p: _waste([peak], (p,)) for p in POOLS} | {"overall": _waste([peak], POOLS)},
        "seqs_mean": statistics.fmean(s["running"] for s in queued),
        "seqs_max": max(s["running"] for s in queued),
        "pool_use_queued": {p: statistics.fmean(s[p]["used_frac"] for s in queued) for p in POOLS},
        "prefix_cache_hits": {p: engine.core.blocks.pools[p].hits for p in POOLS},
        # Blocks in use that no running request holds: a leak while running (should stay 0).
        "untracked_blocks_max": max(s[p]["used"] - s[p]["held"] for s in samples for p in POOLS),
        "preemptions": engine.core.scheduler.num_preemptions,
        "leaked_blocks": {p: engine.core.blocks.pools[p].num_used for p in POOLS},
        "timeline": samples,
        "cached_blocks_after": {p: engine.core.blocks.pools[p].num_cached for p in POOLS},
    }


def measure(llm: LLM, items: list[Item], budget: int, drain: bool = False) -> dict:
    """Run the workload and put it side by side with a static cache for the same maximum length."""
    result = run(llm, items, drain)
    engine = llm.engine
    max_len = max(result["prompt_lens"]) + max(i.max_tokens for i in items)
    per_seq = static_cache_bytes(engine.core.hf_config.text_config, max_len, engine.core.kv.spec.dtype)
    result["hf_max_len"] = max_len
    result["hf_bytes_per_seq"] = per_seq
    result["hf_bytes_per_token"] = per_seq / max_len
    result["engine_bytes_per_token"] = engine.core.kv.spec.bytes_per_block / engine.core.kv.spec.block_size
    result["hf_seqs"] = budget // per_seq
    hf = max(1, result["hf_seqs"])  # a budget below one static cache still counts as one sequence
    result["concurrent_seqs_ratio"] = result["seqs_mean"] / hf
    result["concurrent_seqs_ratio_max"] = result["seqs_max"] / hf
    return result


def markdown(r: dict, block_size: int) -> str:
    w, wp = r["kv_waste"], r["kv_waste_at_peak"]
    ratio, per_token = r["concurrent_seqs_ratio"], r["engine_bytes_per_token"]
    rows = [
        ("KV internal waste, text pool (time avg / at peak)", f"{w[TEXT]:.2%} / {wp[TEXT]:.2%}"),
        ("KV internal waste, image pool (time avg / at peak)", f"{w[IMAGE]:.2%} / {wp[IMAGE]:.2%}"),
        ("KV internal waste, overall (time avg / at peak)", f"{w['overall']:.2%} / {wp['overall']:.2%}"),
        ("block size", str(block_size)),
        ("pool use while queued (text / image)", " / ".join(f"{r['pool_use_queued'][p]:.0%}" for p in POOLS)),
        ("mm-engine sequences at once (mean / max while queued)", f"{r['seqs_mean']:.1f} / {r['seqs_max']}"),
        (f"transformers StaticCache sequences ({r['hf_max_len']} tokens each)", str(r["hf_seqs"])),
        ("concurrent_seqs_ratio (mean / max)", f"{ratio:.2f} / {r['concurrent_seqs_ratio_max']:.2f}"),
        ("KV bytes per token (mm-engine / StaticCache)", f"{per_token:.0f} / {r['hf_bytes_per_token']:.0f}"),
        ("prefix-cache hit blocks (text / image)", " / ".join(str(r["prefix_cache_hits"][p]) for p in POOLS)),
        ("preemptions", str(r["preemptions"])),
        ("blocks held after the end (text / image)", " / ".join(str(r["leaked_blocks"][p]) for p in POOLS)),
        ("steps (queued / total), wall", f"{r['queued_steps']} / {r['steps']}, {r['wall_s']:.0f} s"),
    ]
    lines = ["| metric | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def _length_stats(values: list[int]) -> dict:
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kv-mib", type=int, default=256, help="KV budget for both pools, MiB")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--image-pool-fraction", type=float, default=0.5)
    ap.add_argument("--uses-per-image", type=float, default=2.0, help="image requests per distinct picture")
    ap.add_argument("--policy", default="fcfs", help="scheduling_policy (see the docstring)")
    ap.add_argument("--drain", action="store_true", help="run every request to the end (slower)")
    ap.add_argument("--seed", type=int, default=0)
    # The figures do not depend on speed. One thread, because on a 2-core machine shared with
    # another job, two OpenMP threads wait on each other: decode steps measured 20x slower.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = args.kv_mib * 1024**2
    items = make_workload(args.requests, args.seed, args.uses_per_image)
    llm = LLM(
        str(vlm.bench_model_path()),
        kv_cache_memory_bytes=budget,
        block_size=args.block_size,
        image_pool_fraction=args.image_pool_fraction,
        max_num_seqs=len(items) + 1,  # never the limit: the KV budget is
        scheduling_policy=args.policy,
        seed=args.seed,
    )
    r = measure(llm, items, budget, args.drain)
    print(markdown(r, args.block_size))
    if r["queued_steps"] < 10:
        print(f"warning: the queue emptied after {r['queued_steps']} steps: memory hardly bound the batch;")
        print("         raise --requests or lower --kv-mib for a steady state")
    for p in POOLS:
        held, cached = r["leaked_blocks"][p], r["cached_blocks_after"][p]
        print(f"{p} pool after the end: {held} blocks held (must be 0), {cached} cached for reuse")
    if args.json:
        kinds = {k: [i.max_tokens for i in items if i.kind == k] for k in ("caption", "chat", "text")}
        inputs = {
            "budget_bytes": budget,
            "block_size": args.block_size,
            "image_pool_fraction": args.image_pool_fraction,
            "num_requests": len(items),
            "uses_per_image": args.uses_per_image,
            "drain": args.drain,
            "seed": args.seed,
            "prompt_tokens": _length_stats(r.pop("prompt_lens")),
            "output_tokens": {k: _length_stats(v) for k, v in kinds.items()},
            "machine": machine_info(),
        }
        save_json(args.json, {**r, "inputs": inputs})
        print(f"saved {args.json}")
    return 1 if any(r["leaked_blocks"].values()) or r["untracked_blocks_max"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
