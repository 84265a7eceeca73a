"""The KV cache, the two block pools and (hybrid models) the state pool an engine core starts
with, sized from its config."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mm_engine.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.pools.cpu_memory import huge_page_empty
from mm_engine.pools.hybrid_blocks import HybridBlockManager
from mm_engine.pools.kv_cache import KVCache, KVCacheSpec, kv_memory_bytes, split_blocks
from mm_engine.pools.state_pool import StatePool, StateSpec
from mm_engine.pools.state_snapshots import StateSnapshots


def build_pools(
    config: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    on_count: Callable[[int, int, int], None] | None = None,
    state_spec: StateSpec | None = None,
) -> tuple[KVCache, BlockManager, StatePool | None]:
    """As many blocks of `spec` as the KV memory holds, split between the text and image pools.
    With `state_spec` (a hybrid model), the state pool comes out of the same memory first, within
    `max_state_memory_fraction` of it: a slot per sequence up to `max_num_seqs`, and rows for
    prefix-reuse snapshots (`num_state_snapshots`).
    `on_count(blocks, state slots, snapshot rows)` hears the sizes before the KV is allocated
    (tensor-parallel workers hold their heads of the same blocks and rows)."""
    kv_bytes = kv_memory_bytes(
        config.kv_cache_memory_bytes, device, config.gpu_memory_utilization, CPU_DEFAULT_KV_BYTES
    )
    states = None
    if state_spec is not None:
        per_slot = state_spec.bytes_per_slot
        rows = int(kv_bytes * config.max_state_memory_fraction) // per_slot
        if rows < 1:
            raise ValueError(
                f"one sequence's recurrent state takes {per_slot} bytes, more than "
                f"max_state_memory_fraction of the KV memory; raise kv_cache_memory_bytes"
            )
        want = config.num_state_snapshots
        if want is None:
            want = config.max_num_seqs if config.enable_prefix_caching else 0
        # Slots first (a seat each), but with snapshots wanted, at most half the rows.
        slots = min(config.max_num_seqs, rows if want == 0 else max(1, rows // 2))
        states = StatePool(state_spec, slots, device, min(want, rows - slots))
        kv_bytes -= (slots + len(states.snapshot_rows)) * per_slot
    num_blocks = kv_bytes // spec.bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"KV memory holds {num_blocks} block(s); raise kv_cache_memory_bytes")
    if on_count is not None:
        on_count(num_blocks, *((states.num_slots, len(states.snapshot_rows)) if states else (0, 0)))
    n_text, n_image = split_blocks(num_blocks, config.image_pool_fraction)
    kv = KVCache(spec, num_blocks, device, huge_page_empty if config.cpu_huge_pages else None)
    pools = BlockPool(TEXT, 0, n_text), BlockPool(IMAGE, n_text, n_image)
    if states is not None and states.snapshot_rows and config.enable_prefix_caching:
        snapshots = StateSnapshots(states.snapshot_rows)
        return kv, HybridBlockManager(*pools, config.block_size, snapshots, config.kv_watermark), states
    # A hybrid model without snapshot rows: a cached prefix's KV is no use without the state there.
    caching = config.enable_prefix_caching and states is None
    return kv, BlockManager(*pools, config.block_size, caching, config.kv_watermark), states
