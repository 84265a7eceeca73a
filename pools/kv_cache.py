"""The KV cache tensors: one K and one V tensor per layer, shared by both pools.

Blocks `[0, num_text_blocks)` form the text pool and the rest the image pool. Attention reads any
block through the block table, so the split is purely an allocation policy, invisible to kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Allocates an uninitialised CPU tensor of a shape and dtype (mm_engine.pools.cpu_memory's huge-page
# allocator, say); the pool does not care how.
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # Per KV layer (kv heads, head size) where layers differ (Gemma 4's global layers have wider
    # heads and fewer of them); None: every layer is `num_kv_heads` x `head_dim`.
    layer_dims: tuple[tuple[int, int], ...] | None = None

    def dims(self) -> list[tuple[int, int]]:
        """(kv heads, head size) of each layer's cache."""
        if self.layer_dims is None:
            return [(self.num_kv_heads, self.head_dim)] * self.num_layers
        if len(self.layer_dims) != self.num_layers:
            raise ValueError(f"layer_dims has {len(self.layer_dims)} entries for {self.num_layers} layers")
        return list(self.layer_dims)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * elem * sum(heads * dim for heads, dim in self.dims())


def kv_memory_bytes(
    configured: int | None, device: torch.device, utilization: float, cpu_default: int
) -> int:
    """Bytes the KV cache may take: as configured, else a fixed default on a CPU, else what the
    GPU fraction allows minus what is already taken (weights, other processes), with a margin
    for the activations of one step."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return cpu_default
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total * utilization) - (total - free) - 512 * 1024**2)


def split_blocks(total_blocks: int, image_pool_fraction: float) -> tuple[int, int]:
    """Return (text_blocks, image_blocks); each pool gets at least one block when fraction allows."""
    if not 0.0 <= image_pool_fraction < 1.0:
        raise ValueError(f"image_pool_fraction must be in [0, 1), got {image_pool_fraction}")
    image = int(total_blocks * image_pool_fraction)
    if image_pool_fraction > 0 and image == 0 and total_blocks > 1:
        image = 1
    return total_blocks - image, image


def paged_kv_tensor(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
    empty: Allocator | None = None,
) -> torch.Tensor:
    """One layer's K (or V) cache, indexed `[block, slot, kv_head, dim]`.

    It is stored head-major within each block (`[block, kv_head, slot, dim]`) and handed out as a
    transposed view; the kernels index by strides and do not care. The layout is for the CPU path:
    one KV head's keys of a block are one contiguous run, so gathering a sequence's keys copies
    whole runs and lands them already in the `[kv_head, token, dim]` order attention multiplies in.
    torch.empty: on CPU untouched pages cost no resident memory; stale values are never read
    because attention only looks at slots below each sequence's length. `empty` (CPU only): the
    allocator to use instead of torch.empty (the engine's huge-page one, for fewer TLB misses per
    block read).
    """
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if empty is not None and torch.device(device).type == "cpu":
        return empty(shape, dtype).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=device).transpose(1, 2)


class KVCache:
    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device, empty: Allocator | None = None
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        size = (num_blocks, spec.block_size)
        layers = spec.dims()
        self.k = [paged_kv_tensor(*size, h, d, spec.dtype, device, empty) for h, d in layers]
        self.v = [paged_kv_tensor(*size, h, d, spec.dtype, device, empty) for h, d in layers]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every layer (on the device, in stream order)."""
        for layer in (*self.k, *self.v):
            layer.index_copy_(0, dst, layer.index_select(0, src))
