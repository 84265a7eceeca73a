"""A tensor-parallel worker: rank r of N, started by rank 0 (parallel/executor.py) as
`python -m mm_engine.parallel.worker`, told what it is over its stdin (parallel/step_wire.py).

It loads its shard of the language model straight from the checkpoint, allocates its share of the
KV heads for the block count rank 0 sends, then runs each step's forward on the inputs rank 0
broadcasts, joining the layers' collectives, until told to stop or until rank 0 is gone (its
stdin ends). It samples nothing and keeps no request state: the scheduler and the block tables
are rank 0's alone.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import mm_engine.models as models
from mm_engine.core.model_runner import ModelRunner
from mm_engine.models.loader import load_config, resolve_model_path
from mm_engine.models.platform import platform_for
from mm_engine.parallel.group import destroy_group, init_group
from mm_engine.parallel.ranks import pool_specs, rank_device
from mm_engine.parallel.step_wire import (
    Blocks,
    Encode,
    Start,
    Step,
    SwapDrop,
    SwapIn,
    SwapOut,
    read,
    receive_step,
)
from mm_engine.parallel.vision_dp import encode_share
from mm_engine.pools.kv_cache import KVCache
from mm_engine.pools.state_pool import StatePool
from mm_engine.pools.swap import MirroredSwap
from mm_engine.vision.encoder_cache import EncoderCache


def drop_vision(model: nn.Module) -> None:
    """A worker that never encodes (mm_encoder_tp_mode "rank0": rank 0 sends the embeddings):
    its vision tower and connector go, so that it holds its language-model shard and nothing else."""
    for name, _ in list(model.named_children()):
        if name != "language_model":
            setattr(model, name, nn.Identity())


def main() -> int:
    pipe = sys.stdin.buffer
    first = read(pipe)
    if not isinstance(first, Start):
        return 2
    start = first.settings
    config = start.config
    torch.set_num_threads(start.threads)  # a process of our own: its threads are ours to set
    device = rank_device(config, start.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parent = os.getppid()  # rank 0: once it is gone, so is the group
    tp = init_group(start.rank, start.world, start.port, device, lambda: os.getppid() == parent)
    try:
        path = resolve_model_path(config.model)
        hf_config = load_config(path)
        platform = platform_for(config, device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model = models.load_model(
                path, hf_config, config.torch_dtype("dtype"), config.torch_dtype("vision_dtype"), device,
                platform, pack_weights=config.cpu_packed_weights, tp=tp,
            )  # fmt: skip
        if config.mm_encoder_tp_mode != "data":  # else it encodes a share of each step's images
            drop_vision(model)
        blocks = read(pipe)
        if not isinstance(blocks, Blocks):
            return 0
        spec, sspec = pool_specs(config, hf_config.text_config, model.language_model, start.world)
        kv = KVCache(spec, blocks.num_blocks, device)
        states = StatePool(sspec, blocks.state_slots, device, blocks.state_snapshots) if sspec else None
        runner = ModelRunner(model, kv, platform.backend, device, EncoderCache(1), states=states)
        swap = MirroredSwap(kv, states)
        while (msg := read(pipe)) is not None:
            if isinstance(msg, Step):
                runner.forward(*receive_step(msg, tp))
            elif isinstance(msg, Encode):
                encode_share(msg, model, tp)
            elif isinstance(msg, SwapOut):
                swap.swap_out(msg.request_id, msg.blocks, msg.state_slot)
            elif isinstance(msg, SwapIn):
                swap.swap_in(msg.request_id, msg.blocks, msg.state_slot)
            elif isinstance(msg, SwapDrop):
                swap.drop(msg.request_id)
            else:
                break
        return 0  # told to stop, or rank 0 is gone
    finally:
        destroy_group()


if __name__ == "__main__":
    raise SystemExit(main())
