"""The scheduler an engine core runs, made from the engine's settings: the policy (fcfs or priority,
with the background tier of batch work) and the budgets and caps the scheduler applies per step."""

from __future__ import annotations

from mm_engine.config import EngineConfig
from mm_engine.pools.block_manager import BlockManager
from mm_engine.pools.state_pool import StatePool
from mm_engine.pools.swap import HostSwap
from mm_engine.sched.policy import make_policy
from mm_engine.sched.scheduler import Scheduler
from mm_engine.vision.encoder_cache import EncoderCache


def build_scheduler(
    config: EngineConfig, blocks: BlockManager, encoder_cache: EncoderCache, encoder_budget: int,
    swap: HostSwap | None, states: StatePool | None, *, whole_images: bool, device_type: str,
    sliced_encoding: bool = False,
) -> Scheduler:  # fmt: skip
    """`sliced_encoding`: whether the runner can encode an image a share at a time (the setting,
    and a tower it can pause)."""
    policy = make_policy(
        config.scheduling_policy,
        config.image_priority_boost,
        config.max_wait_s,
        config.preemption_margin,
        config.background_priority,
    )
    return Scheduler(
        blocks,
        policy,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        encoder_cache,
        encoder_budget,
        swap,
        config.max_waiting_requests,
        whole_images=whole_images,
        decode_first=config.decode_first,
        decode_step_prefill_tokens=config.prefill_cap(device_type),
        states=states,
        step_time_factor=config.step_time_factor,
        background_step_tokens=config.background_step_tokens,
        background_prefill_tokens=config.background_prefill_tokens,
        sliced_encoding=sliced_encoding,
    )
