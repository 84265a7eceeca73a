"""A tensor-parallel group: this process's rank among N over torch.distributed (NCCL on CUDA,
gloo on CPU), and the three collectives the sharded language model needs.

Rank 0 is the engine core (scheduler, block manager, sampling); ranks 1..N-1 are workers that
only run the language model's forward on their shard (parallel/worker.py).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    shm: Any = None  # ShmCollectives for ranks on one CPU machine; None: torch.distributed's own

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.shm is not None and self.shm.fits(x) and x.is_contiguous():
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's `[..., n]` side by side along the last dimension (vocab-parallel logits)."""
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return torch.cat(self.shm.all_gather(x), dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's `x` into every rank's (a step's inputs)."""
        if self.shm is not None and self.shm.fits(x) and x.is_contiguous():
            self.shm.broadcast(x)
        else:
            dist.broadcast(x, src=0)

    # The data-parallel vision tower (parallel/vision_dp.py): a worker's images from rank 0, and
    # every rank's features gathered on rank 0.
    def send(self, x: torch.Tensor, dst: int) -> None:
        dist.send(x.contiguous(), dst)

    def recv(self, x: torch.Tensor) -> None:
        dist.recv(x, src=0)

    def gather_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (all of one shape) on rank 0, in rank order; None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return parts

    def shard(self, size: int) -> tuple[int, int]:
        """[start, end) of this rank's share of `size` (the last share may be shorter)."""
        per = -(-size // self.world)
        start = min(size, self.rank * per)
        return start, min(size, start + per)


def init_group(rank: int, world: int, port: int, device: torch.device, alive: Callable[[], bool]) -> TPGroup:
    """Join the group of `world` ranks meeting at `port`. On a CPU the collectives go through
    shared memory (parallel/shm_collectives.py); `alive` says whether the other ranks still are
    (checked while one waits for them there)."""
    from mm_engine.parallel import shm_collectives

    backend = "nccl" if device.type == "cuda" else "gloo"
    path = f"/dev/shm/mm-engine-tp-{port}"
    use_shm = device.type == "cpu" and world > 1 and shm_collectives.supported() and os.path.isdir("/dev/shm")
    timeout = COLLECTIVE_TIMEOUT.total_seconds()
    shm = None
    if use_shm and rank == 0:  # made before anyone can get past the rendezvous below
        shm = shm_collectives.ShmCollectives(path, 0, world, True, alive, timeout)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    if use_shm:
        if rank != 0:
            shm = shm_collectives.ShmCollectives(path, rank, world, False, alive, timeout)
        dist.barrier()  # everyone has it mapped: the name can go (nothing is left behind on a crash)
        if rank == 0:
            os.unlink(path)
    return TPGroup(rank, world, device, shm)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_divisible(text_config, world: int) -> None:
    """Attention heads, KV heads and the MLP width (each expert's, with MoE; the shared expert's)
    must split evenly, and a hybrid model's linear-attention key and value heads."""
    names = ["num_attention_heads"]
    per_layer = getattr(text_config, "per_layer_config", None)  # Gemma 4: KV heads differ by layer
    layers = range(text_config.num_hidden_layers) if per_layer is not None else ()
    heads = [per_layer[i].num_key_value_heads for i in layers]
    if len(set(heads)) > 1:
        for i, n in enumerate(heads):
            if n % world:
                raise ValueError(f"tensor_parallel_size {world} does not divide layer {i}'s {n} KV heads")
    else:
        names.append("num_key_value_heads")
    if getattr(text_config, "num_experts", 0) or getattr(text_config, "n_routed_experts", 0):
        names.append("moe_intermediate_size")  # each expert's width is split too
    optional = (
        "intermediate_size",
        "shared_expert_intermediate_size",
        "linear_num_key_heads",
        "linear_num_value_heads",
    )
    names += [name for name in optional if getattr(text_config, name, None)]
    for name in names:
        n = getattr(text_config, name)
        if n % world:
            raise ValueError(
                f"tensor_parallel_size {world} does not divide the language model's {name} ({n})"
            )
