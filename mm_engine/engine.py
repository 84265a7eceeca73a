"""The engine: requests in, one scheduled forward pass per `step()`, outputs out.

    step():  schedule -> encode images + forward (runner) -> sample -> append, detokenize, finish

Everything that decides *what* runs lives in the scheduler and the pools; everything that decides
*how* it runs lives in the runner. The engine only moves requests between them.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from mm_engine import models
from mm_engine.admission import Admission
from mm_engine.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from mm_engine.cpu_memory import huge_page_empty, tune_malloc
from mm_engine.detokenizer import IncrementalDetokenizer
from mm_engine.faults import StepFailedError, is_device_fault
from mm_engine.inputs import InputProcessor, find_chat_template
from mm_engine.model_loader import load_config, resolve_model_path
from mm_engine.model_runner import ModelRunner
from mm_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mm_engine.platform import make_platform
from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.pools.kv_cache import KVCache, KVCacheSpec, split_blocks
from mm_engine.pools.swap import HostSwap
from mm_engine.request import ImageSpan, Request
from mm_engine.sampler import Sampler
from mm_engine.sampling_params import RequestOutputKind, SamplingParams
from mm_engine.sched.policy import make_policy
from mm_engine.sched.scheduler import ScheduledBatch, Scheduler
from mm_engine.thread_tokenizer import PerThreadTokenizer
from mm_engine.vision.encoder_cache import EncoderCache

IMAGE_TOKEN_FRACTION = 0.25  # of max_model_len: the default max_image_tokens


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        if self.device.type == "cpu" and config.cpu_tune_malloc:
            tune_malloc()
        path = resolve_model_path(config.model)
        self.hf_config = load_config(path)
        self.platform = make_platform(self.device, config.attention_backend)
        backend = self.platform.backend
        # The engine thread detokenizes with `self.tokenizer`; input processing runs on other
        # threads, each with its own copy.
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizers = PerThreadTokenizer(self.tokenizer)
        processing = models.make_processing(path, tokenizers, self.hf_config, config.mm_processor_kwargs)
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
        self.inputs = InputProcessor(tokenizers, processing, find_chat_template(path, self.tokenizer))
        self.eos_token_ids = self._eos_ids(path)
        text_cfg = self.hf_config.text_config
        self.max_model_len = config.max_model_len or text_cfg.max_position_embeddings
        self.max_image_tokens = config.max_image_tokens or self._default_image_cap(processing)
        # No token is longer than the vocabulary's longest string: text beyond max_model_len of
        # those (twice over, for normalisers that fold characters) cannot fit.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.inputs.max_prompt_chars = 2 * self.max_model_len * max(longest, 1)
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
        default_budget = max(config.max_num_batched_tokens, self.max_image_tokens)
        self.encoder_budget = config.max_num_encoder_tokens or default_budget
        emb = self.model.language_model.embed_tokens
        self.admission = Admission(
            max_model_len=self.max_model_len,
            max_image_tokens=self.max_image_tokens,
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
        self.runner = ModelRunner(self.model, self.kv, backend, self.device, self.encoder_cache)
        # The engine's own random stream for unseeded requests: torch's global RNG is the caller's.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.device_lost = False  # set by a step that failed with a device fault

    # ---- requests in -------------------------------------------------------------------------

    def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> str:
        text, ids, spans = self.inputs.process(prompt)
        return self.add_processed(text, ids, spans, params, request_id, priority)

    def add_chat_request(
        self, messages: list[dict], params: SamplingParams, request_id: str | None = None, priority: int = 0,
        mm_processor_kwargs: dict | None = None,
    ) -> str:  # fmt: skip
        text, ids, spans = self.inputs.chat(messages, mm_processor_kwargs)
        return self.add_processed(text, ids, spans, params, request_id, priority)

    def add_processed(
        self, text: str | None, ids: list[int], spans: list[ImageSpan], params: SamplingParams,
        request_id: str | None = None, priority: int = 0,
    ) -> str:  # fmt: skip
        """Queue a request whose inputs `self.inputs` already processed (possibly on another thread)."""
        if self.device_lost:
            raise RuntimeError("the device failed earlier; this engine cannot run any more")
        self.check_fits(ids, spans, params)
        seq = next(self._seq)
        request_id = str(seq) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            images=spans,
            params=params,
            arrival_time=time.time(),
            seq_no=seq,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            prompt=text,
            priority=priority,
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
        )
        positions = self.model.positions(ids, spans) if spans else None
        if positions is not None:
            req.mrope_positions, req.mrope_delta = positions.prompt, positions.delta
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
        self.scheduler.add(req)  # may refuse (queue full) before anything is recorded
        self.requests[request_id] = req
        return request_id

    def check_fits(self, ids: list[int], spans: list[ImageSpan], params: SamplingParams) -> None:
        """Refuse a request that could never run, before it takes anything."""
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

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return an output for each request that advanced.

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

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
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
            out = self._output(req, self._append(req, token, now))
            if out is not None:
                outputs.append(out)
            if req.is_finished:
                del self.requests[req.request_id]
        return outputs

    def _append(self, req: Request, token: int, now: float) -> str:
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if token in req.eos_token_ids or token in req.params.stop_token_ids:
            return self._finish(req, "stop", token if token in req.params.stop_token_ids else None)
        delta = req.detokenizer.step([token])
        if req.detokenizer.stopped:
            return delta + self._finish(req, "stop", req.detokenizer.stop_str)
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return delta + self._finish(req, "length")
        return delta

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> str:
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finished_time = time.time()
        self.scheduler.finish(req)
        self.runner.release(req.request_id)
        return req.detokenizer.flush() if reason != "abort" else ""

    def _output(self, req: Request, delta: str) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not req.is_finished:
            return None
        if kind is RequestOutputKind.DELTA:  # one step appends one token
            text, token_ids = delta, req.token_ids[-1:]
        else:
            text, token_ids = req.detokenizer.text, req.output_token_ids  # a fresh slice
        completion = CompletionOutput(0, text, token_ids, req.finish_reason, req.stop_reason)
        metrics = RequestMetrics(
            req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finished_time
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.is_finished,
            metrics=metrics,
            num_cached_tokens=req.num_cached_tokens,
            delta_text=delta,
        )

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

    def _default_image_cap(self, processing) -> int:
        """A family whose image size decides its token count gets a cap, so that one huge upload
        does not take thousands of tokens unasked; a fixed count (LLaVA-1.5) needs none."""
        if processing.fixed_tokens is not None:
            return max(processing.fixed_tokens, self.max_model_len)
        return max(1, int(self.max_model_len * IMAGE_TOKEN_FRACTION))

    def _kv_bytes(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        # What the fraction allows minus what is already taken (weights, other processes), with a
        # margin for activations of one step.
        return max(0, int(total * self.config.gpu_memory_utilization) - (total - free) - 512 * 1024**2)

    def _eos_ids(self, path) -> frozenset[int]:
        ids: set[int] = set()
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
            ids.update([eos] if isinstance(eos, int) else eos or [])
        except OSError:  # no generation_config.json
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)
