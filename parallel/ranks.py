"""What rank 0 and the workers agree on: a worker's start-up message, each rank's device, and
each rank's KV layout."""

from __future__ import annotations

import msgspec
import torch

from mm_engine.config import EngineConfig
from mm_engine.pools.kv_cache import KVCacheSpec


class WorkerStart(msgspec.Struct):
    config: EngineConfig
    rank: int
    world: int
    port: int
    threads: int  # torch threads (on CPU the ranks share the cores)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Tensor-parallel rank `rank` of this engine core: on CUDA its own GPU, after those of the
    data-parallel cores before it."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    return torch.device("cuda", config.data_parallel_rank * config.tensor_parallel_size + rank)


def kv_spec(config: EngineConfig, text_config, lm, world: int) -> KVCacheSpec:
    """A rank's KV layout: its share of the KV heads, every layer, the engine's blocks."""
    heads = text_config.num_key_value_heads // world
    return KVCacheSpec(len(lm.layers), heads, lm.head_dim, config.block_size, config.torch_dtype())
