"""A tensor-parallel group: this process's rank among N over torch.distributed (NCCL on CUDA,
gloo on CPU), and the three collectives the sharded language model needs.

Rank 0 is the engine core (scheduler, block manager, sampling); ranks 1..N-1 are workers that
only run the language model's forward on their shard (parallel/worker.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A worker that dies mid-collective is noticed by gloo/NCCL as a closed peer; this bounds the
# wait for one that hangs instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


class ParallelError(RuntimeError):
    """The group cannot go on (a rank died or a collective failed): the engine stops."""


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    world: int
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, vocab-parallel embeddings)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's `[..., n]` side by side along the last dimension (vocab-parallel logits)."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, size: int) -> tuple[int, int]:
        """[start, end) of this rank's share of `size` (the last share may be shorter)."""
        per = -(-size // self.world)
        start = min(size, self.rank * per)
        return start, min(size, start + per)


def init_group(rank: int, world: int, port: int, device: torch.device) -> TPGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return TPGroup(rank, world, device)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_divisible(text_config, world: int) -> None:
    """Attention heads, KV heads and the MLP width must split evenly over the ranks."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(text_config, name)
        if n % world:
            raise ValueError(
                f"tensor_parallel_size {world} does not divide the language model's {name} ({n})"
            )
