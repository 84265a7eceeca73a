"""What rank 0 and the workers agree on: a worker's start-up message, each rank's device, its
torch threads, and its KV layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgspec
import torch

from mm_engine.config import EngineConfig
from mm_engine.pools.kv_cache import KVCacheSpec
from mm_engine.pools.state_pool import StateSpec


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


def rank_threads(config: EngineConfig) -> int | None:
    """Torch threads of each tensor-parallel rank: the setting, or an even share of this process's
    (the ranks of a CPU machine share its cores); None without tensor parallelism."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    if not config.parallel:
        return None
    return max(1, torch.get_num_threads() // config.tensor_parallel_size)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Rank 0's work with `n` torch threads, on the calling thread only (an OpenMP thread count is
    the thread's own), and what it had before put back after: rank 0 may be the user's process."""
    before = None if n is None else torch.get_num_threads()
    if before is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kv_spec(config: EngineConfig, text_config, lm, world: int) -> KVCacheSpec:
    """A rank's KV layout: its share of the KV heads, every layer with a paged KV cache (a hybrid
    model's linear-attention layers and Gemma 4's KV-sharing layers have none), the engine's
    blocks; a model whose layers differ in heads says so in `kv_layer_dims` (this rank's)."""
    dims = getattr(lm, "kv_layer_dims", None)
    if dims is not None:
        return KVCacheSpec(lm.num_kv_layers, *dims[0], config.block_size, config.torch_dtype(), tuple(dims))
    heads = text_config.num_key_value_heads // world
    return KVCacheSpec(lm.num_kv_layers, heads, lm.head_dim, config.block_size, config.torch_dtype())


def state_spec(config: EngineConfig, text_config, lm, world: int) -> StateSpec | None:
    """A rank's recurrent state per sequence of a hybrid model (every linear-attention layer, its
    share of the heads); None for a model without linear-attention layers."""
    layers = getattr(lm, "num_linear_layers", 0)
    if not layers:
        return None
    keys = text_config.linear_num_key_heads // world * text_config.linear_key_head_dim
    values = text_config.linear_num_value_heads // world * text_config.linear_value_head_dim
    return StateSpec(
        num_layers=layers,
        conv_channels=2 * keys + values,
        conv_kernel=text_config.linear_conv_kernel_dim,
        num_heads=text_config.linear_num_value_heads // world,
        key_dim=text_config.linear_key_head_dim,
        value_dim=text_config.linear_value_head_dim,
        dtype=config.torch_dtype(),
    )


def pool_specs(config: EngineConfig, text_config, lm, world: int) -> tuple[KVCacheSpec, StateSpec | None]:
    """Rank 0's KV layout and (hybrid models) recurrent-state layout."""
    return kv_spec(config, text_config, lm, world), state_spec(config, text_config, lm, world)
