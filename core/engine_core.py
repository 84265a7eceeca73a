"""The engine core: requests in, one scheduled forward pass per `step()`, new tokens out.

    step():  schedule -> encode images + forward (runner) -> sample -> append, finish

Everything that decides *what* runs lives in the scheduler and the pools; everything that decides
*how* it runs lives in the runner. The core owns no tokenizer: it gets token ids and returns token
ids (core/types.py), so it runs the same in the caller's process or in a process of its own.
"""

from __future__ import annotations

import itertools
import time

import torch

from mm_engine import models
from mm_engine.admission import Admission
from mm_engine.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from mm_engine.core.types import CoreOutput, CoreRequest
from mm_engine.cpu_memory import huge_page_empty, tune_malloc
from mm_engine.faults import StepFailedError, is_device_fault
from mm_engine.model_loader import load_config, resolve_model_path
from mm_engine.model_runner import ModelRunner
from mm_engine.platform import make_platform
from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.pools.kv_cache import KVCache, KVCacheSpec, split_blocks
from mm_engine.pools.swap import HostSwap
from mm_engine.request import Request
from mm_engine.sampler import Sampler
from mm_engine.sched.policy import make_policy
from mm_engine.sched.scheduler import ScheduledBatch, Scheduler
from mm_engine.vision.encoder_cache import EncoderCache


class EngineCore:
    def __init__(self, config: EngineConfig, max_image_tokens: int) -> None:
        """`max_image_tokens`: the per-image token cap (the frontend resolves its default, which
        depends on the family's processing)."""
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cpu" and config.cpu_tune_malloc:
            tune_malloc()
        path = resolve_model_path(config.model)
        self.hf_config = load_config(path)
        self.platform = make_platform(self.device, config.attention_backend)
        # Building the modules runs their random init (overwritten by the checkpoint): on a fork of
        # torch's RNG, so the caller's stream is where it was.
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            self.model = models.load_model(
                path,
                self.hf_config,
                config.torch_dtype("dtype"),
                config.torch_dtype("vision_dtype"),
                self.device,
                self.platform,
                pack_weights=config.cpu_packed_weights,
            )
        text_cfg = self.hf_config.text_config
        self.max_model_len = config.max_model_len or text_cfg.max_position_embeddings
        self.max_image_tokens = max_image_tokens
        lm = self.model.language_model
        spec = KVCacheSpec(
            len(lm.layers), text_cfg.num_key_value_heads, lm.head_dim, config.block_size, config.torch_dtype()
        )
        num_blocks = self._kv_bytes() // spec.bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"KV memory holds {num_blocks} block(s); raise kv_cache_memory_bytes")
        n_text, n_image = split_blocks(num_blocks, config.image_pool_fraction)
        self.kv = KVCache(spec, num_blocks, self.device, huge_page_empty if config.cpu_huge_pages else None)
        self.blocks = BlockManager(
            BlockPool(TEXT, 0, n_text),
            BlockPool(IMAGE, n_text, n_image),
            config.block_size,
            config.enable_prefix_caching,
            config.kv_watermark,
        )
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes)
        # By default one step may encode at least one whole image, whatever the token budget.
        default_budget = max(config.max_num_batched_tokens, max_image_tokens)
        self.encoder_budget = config.max_num_encoder_tokens or default_budget
        emb = lm.embed_tokens
        self.admission = Admission(
            max_model_len=self.max_model_len,
            max_image_tokens=max_image_tokens,
            max_num_batched_tokens=config.max_num_batched_tokens,
            encoder_cache_bytes=self.encoder_cache.capacity_bytes,
            encoder_budget=self.encoder_budget,
            vocab_size=emb.num_embeddings,
            bytes_per_embed=(1 + self.model.num_deepstack) * emb.embedding_dim * emb.weight.element_size(),
            whole_images=self.model.bidirectional_images,
        )
        policy = make_policy(
            config.scheduling_policy, config.image_priority_boost, config.max_wait_s, config.preemption_margin
        )
        self.swap = HostSwap(self.kv, config.swap_space_bytes) if config.preemption_mode == "swap" else None
        self.scheduler = Scheduler(
            self.blocks,
            policy,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.encoder_cache,
            self.encoder_budget,
            self.swap,
            config.max_waiting_requests,
            whole_images=self.model.bidirectional_images,
        )
        self.runner = ModelRunner(self.model, self.kv, self.platform.backend, self.device, self.encoder_cache)
        # The engine's own random stream for unseeded requests: torch's global RNG is the caller's.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.device_lost = False  # set by a step that failed with a device fault

    # ---- requests in -------------------------------------------------------------------------

    def add(self, new: CoreRequest) -> None:
        """Queue a request; ValueError when it could never run, QueueFullError when the queue is."""
        if self.device_lost:
            raise RuntimeError("the device failed earlier; this engine cannot run any more")
        if new.request_id in self.requests:
            raise ValueError(f"request id {new.request_id!r} is already in use")
        self.check_fits(new)
        params = new.params
        req = Request(
            request_id=new.request_id,
            prompt_token_ids=new.token_ids,
            images=new.images,
            params=params,
            arrival_time=new.arrival_time or time.time(),
            seq_no=next(self._seq),
            eos_token_ids=new.eos_token_ids,
            priority=new.priority,
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
        )
        positions = self.model.positions(new.token_ids, new.images) if new.images else None
        if positions is not None:
            req.mrope_positions, req.mrope_delta = positions.prompt, positions.delta
        self.scheduler.add(req)  # may refuse (queue full) before anything is recorded
        self.requests[new.request_id] = req

    def check_fits(self, new: CoreRequest) -> None:
        """Refuse a request that could never run, before it takes anything."""
        ids, spans, params = new.token_ids, new.images, new.params
        self.admission.check(ids, spans, params)
        probe = Request("probe", ids, spans, params, 0.0, -1, frozenset())
        need = self.blocks.blocks_needed(probe, min(len(ids) + params.max_tokens, self.max_model_len))
        for pool, n in need.items():
            if n > self.blocks.pools[pool].num_blocks:
                raise ValueError(
                    f"the request needs {n} {pool}-pool blocks but the pool has only "
                    f"{self.blocks.pools[pool].num_blocks}; raise kv_cache_memory_bytes or shorten it"
                )

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._finish(req, "abort")

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Run one scheduled forward pass; return the new tokens of each request that sampled.

        Raises StepFailedError when the pass fails: the requests it held are dropped (their
        blocks freed), every other request stays as it was."""
        if self.device_lost:
            raise RuntimeError("the device failed earlier; this engine cannot run any more")
        batch = self.scheduler.schedule(time.time())
        for req in batch.preempted:  # recomputed from the start: its image features go too
            self.runner.release(req.request_id)
        if not batch.items:
            return []
        try:
            return self._run(batch)
        except Exception as exc:
            self.device_lost = is_device_fault(exc)
            failed = [req.request_id for req, _ in batch.items]
            for rid in failed:
                self.abort(rid)
            raise StepFailedError(failed, self.device_lost) from exc

    def _run(self, batch: ScheduledBatch) -> list[CoreOutput]:
        logits, sampling = self.runner.execute(batch.items)
        for req, n in batch.items:
            req.num_computed_tokens += n
            self.blocks.commit(req)
        if not sampling:  # only mid-prompt chunks this step
            return []
        new_tokens = self.sampler.sample(
            logits,
            [batch.items[k][0].params for k in sampling],
            [batch.items[k][0].generator for k in sampling],
        )
        now = time.time()
        outputs = []
        for k, token in zip(sampling, new_tokens, strict=True):
            req = batch.items[k][0]
            outputs.append(self._append(req, token, now))
            if req.is_finished:
                del self.requests[req.request_id]
        return outputs

    def _append(self, req: Request, token: int, now: float) -> CoreOutput:
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        out = CoreOutput(req.request_id, [token], num_cached_tokens=req.num_cached_tokens)
        if token in req.eos_token_ids or token in req.params.stop_token_ids:
            out.ended_by_token = True
            out.stop_token = token if token in req.params.stop_token_ids else None
            self._finish(req, "stop", out.stop_token)
        elif req.num_tokens - req.num_prompt_tokens >= req.params.max_tokens or (
            req.num_tokens >= self.max_model_len
        ):
            self._finish(req, "length")
        out.finish_reason = req.finish_reason
        out.first_scheduled_time, out.first_token_time = req.first_scheduled_time, req.first_token_time
        out.finished_time = req.finished_time
        return out

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.time()
        self.scheduler.finish(req)
        self.runner.release(req.request_id)

    # ---- state -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def kv_report(self) -> dict[str, dict]:
        """Per pool: blocks (total, used, free, cached), slots (allocated, filled), internal waste,
        prefix-cache queries/hits/misses, evictions, preemptions; plus swap and encoder-cache counts."""
        report = self.blocks.report([*self.scheduler.running, *self.scheduler.waiting])
        for name in (TEXT, IMAGE):
            report[name]["preemptions"] = self.scheduler.preemptions_by_pool[name]
        report["swap"] = {
            "swapped_out_blocks": self.swap.swapped_out_blocks if self.swap else 0,
            "swapped_in_blocks": self.swap.swapped_in_blocks if self.swap else 0,
            "host_bytes_used": self.swap.used_bytes if self.swap else 0,
        }
        report["encoder_cache"] = {
            "entries": len(self.encoder_cache),
            "bytes_used": self.encoder_cache.used_bytes,
            "hits": self.encoder_cache.hits,
            "misses": self.encoder_cache.misses,
            "evictions": self.encoder_cache.evictions,
        }
        return report

    def stats(self) -> dict:
        """Counters and gauges for metrics: plain numbers, cheap to read every scrape."""
        usage = {
            name: (pool.num_used / pool.num_blocks if pool.num_blocks else 0.0)
            for name, pool in self.blocks.pools.items()
        }
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": usage,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "num_encoded_images_total": self.runner.num_encoded_images,
            "prefix_cache_queries_total": {n: p.queries for n, p in self.blocks.pools.items()},
            "prefix_cache_hits_total": {n: p.hits for n, p in self.blocks.pools.items()},
            "encoder_cache_hits_total": self.encoder_cache.hits,
        }

    def _kv_bytes(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        # What the fraction allows minus what is already taken (weights, other processes), with a
        # margin for activations of one step.
        return max(0, int(total * self.config.gpu_memory_utilization) - (total - free) - 512 * 1024**2)
