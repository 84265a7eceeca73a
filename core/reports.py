"""What an engine core tells about itself: the KV report and the counters behind the metrics.
Both read the core's parts and change nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mm_engine.pools.block_manager import IMAGE, TEXT

if TYPE_CHECKING:
    from mm_engine.core.engine_core import EngineCore


def kv_report(core: EngineCore) -> dict[str, dict]:
    """Per pool: blocks (total, used, free, cached), slots (allocated, filled), internal waste,
    prefix-cache queries/hits/misses, evictions, preemptions; plus swap and encoder-cache counts,
    what the tower encoded by modality (images, clips: inputs and tokens), and (hybrid models)
    the recurrent-state slots."""
    sched, swap, cache = core.scheduler, core.swap, core.encoder_cache
    report = core.blocks.report([*sched.running, *sched.waiting])
    for name in (TEXT, IMAGE):
        report[name]["preemptions"] = sched.preemptions_by_pool[name]
    report["swap"] = {
        "swapped_out_blocks": swap.swapped_out_blocks if swap else 0,
        "swapped_in_blocks": swap.swapped_in_blocks if swap else 0,
        "host_bytes_used": swap.used_bytes if swap else 0,
    }
    if core.states is not None:  # a hybrid model's recurrent-state slots (and prefix snapshots)
        snapshots = getattr(core.blocks, "snapshots", None)
        report["state"] = {**core.states.report(), **(snapshots.report() if snapshots else {})}
    report["encoder_cache"] = {
        "entries": len(cache),
        "bytes_used": cache.used_bytes,
        "hits": cache.hits,
        "misses": cache.misses,
        "evictions": cache.evictions,
    }
    # What the tower encoded, by modality: a clip's frames are vision tokens of the image pool.
    report["encoded"] = {m: {"inputs": n, "tokens": t} for m, (n, t) in core.runner.encoded.items()}
    return report


def core_stats(core: EngineCore) -> dict:
    """Counters and gauges for metrics: plain numbers, cheap to read every scrape."""
    pools = core.blocks.pools
    return {
        "num_requests_running": len(core.scheduler.running),
        "num_requests_waiting": len(core.scheduler.waiting),
        "kv_cache_usage_perc": {
            n: (p.num_used / p.num_blocks if p.num_blocks else 0.0) for n, p in pools.items()
        },
        "num_preemptions_total": core.scheduler.num_preemptions,
        "num_encoded_images_total": core.runner.num_encoded_images,
        "encoded_inputs_total": {m: n for m, (n, _) in core.runner.encoded.items()},
        "encoded_tokens_total": {m: t for m, (_, t) in core.runner.encoded.items()},
        "prefix_cache_queries_total": {n: p.queries for n, p in pools.items()},
        "prefix_cache_hits_total": {n: p.hits for n, p in pools.items()},
        "encoder_cache_hits_total": core.encoder_cache.hits,
        # Hybrid models' recurrent-state slots (counts, so that data-parallel cores add up).
        "state_slots_used": core.states.num_used if core.states else 0,
        "state_slots_total": core.states.num_slots if core.states else 0,
    }
