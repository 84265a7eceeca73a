"""The engine core: requests in, one scheduled forward pass per `step()`, new tokens out.

    step():  schedule -> encode images + forward (runner) -> sample -> append, finish

Everything that decides *what* runs lives in the scheduler and the pools; everything that decides
*how* it runs lives in the runner. The core owns no tokenizer: it gets token ids and returns token
ids (core/types.py), so it runs the same in the caller's process or in a process of its own.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from transformers import AutoTokenizer

import mm_engine.models as models
from mm_engine.config import EngineConfig
from mm_engine.core.admission import Admission
from mm_engine.core.background_yield import YieldingSteps
from mm_engine.core.faults import StepFailedError, is_device_fault
from mm_engine.core.launcher import Launched, make_launcher
from mm_engine.core.logit_adjust import row_contexts
from mm_engine.core.model_runner import ModelRunner
from mm_engine.core.overlap import OverlappedSteps
from mm_engine.core.prompt_logprobs import prompt_logprobs
from mm_engine.core.reports import core_stats, kv_report
from mm_engine.core.sampler import Sampler
from mm_engine.core.scheduling import build_scheduler
from mm_engine.core.stopping import append_sampled
from mm_engine.core.structured_output import Grammars, GrammarWaitlist
from mm_engine.core.types import CoreOutput, CoreRequest, TokenLogprobs
from mm_engine.models.loader import load_config, resolve_model_path
from mm_engine.models.platform import platform_for
from mm_engine.parallel.executor import TensorParallel
from mm_engine.parallel.ranks import pool_specs, rank_device, rank_threads
from mm_engine.parallel.vision_dp import DataParallelEncoder
from mm_engine.pools.cpu_memory import tune_malloc
from mm_engine.pools.setup import build_pools
from mm_engine.pools.swap import HostSwap
from mm_engine.request import Request
from mm_engine.sched.scheduler import QueueFullError, ScheduledBatch
from mm_engine.vision.encoder_cache import EncoderCache

logger = logging.getLogger("mm_engine.core")


class EngineCore(OverlappedSteps, YieldingSteps):
    def __init__(self, config: EngineConfig, max_image_tokens: int, grammars: Grammars | None = None) -> None:
        """`max_image_tokens`: the per-image token cap (the frontend resolves its default, which
        depends on the family's processing). `grammars`: the frontend's, when it runs in this
        process and masks the same vocabulary width, so a spec is compiled once, not twice."""
        self.config = config
        self.device = rank_device(config, 0) if config.parallel else config.torch_device()
        self.max_image_tokens = max_image_tokens
        if self.device.type == "cpu" and config.cpu_tune_malloc:
            tune_malloc()
        path = resolve_model_path(config.model)
        self.hf_config = load_config(path)
        self.platform = platform_for(config, self.device)
        # Tensor parallelism: the workers start first, so that they load their shards meanwhile.
        self.parallel = None
        if config.parallel:
            models.check_tensor_parallel(self.hf_config, config.tensor_parallel_size)
            self.parallel = TensorParallel(config)
        try:
            self._build(config, path, grammars)
        except BaseException:
            if self.parallel is not None:
                self.parallel.close()
            raise

    def _build(self, config: EngineConfig, path, grammars: Grammars | None) -> None:
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
                tp=self.parallel.group if self.parallel is not None else None,
            )
        text_cfg = self.hf_config.text_config
        self.max_model_len = config.max_model_len or text_cfg.max_position_embeddings
        lm = self.model.language_model
        spec, sspec = pool_specs(config, text_cfg, lm, config.tensor_parallel_size)
        share = self.parallel.share_num_blocks if self.parallel is not None else None
        self.kv, self.blocks, self.states = build_pools(config, spec, self.device, share, sspec)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes)
        # By default one step may encode at least one whole image, whatever the token budget.
        default_budget = max(config.max_num_batched_tokens, self.max_image_tokens)
        self.encoder_budget = config.max_num_encoder_tokens or default_budget
        emb = lm.embed_tokens
        self.admission = Admission(
            max_model_len=self.max_model_len,
            max_image_tokens=self.max_image_tokens,
            max_num_batched_tokens=config.max_num_batched_tokens,
            encoder_cache_bytes=self.encoder_cache.capacity_bytes,
            encoder_budget=self.encoder_budget,
            vocab_size=emb.num_embeddings,
            bytes_per_embed=(1 + self.model.num_deepstack) * emb.embedding_dim * emb.weight.element_size(),
            whole_images=self.model.bidirectional_images,
            refused_tokens=tuple(self.model.refused_tokens.items()),
        )
        swap = config.preemption_mode == "swap"  # (under TP each worker repeats the swaps)
        self.swap = HostSwap(self.kv, config.swap_space_bytes, self.parallel, self.states) if swap else None
        # (Not under TP: there the ranks encode together, or rank 0 alone for its peers.)
        sliced = config.sliced_encoding and self.parallel is None and self.model.tower_depth > 0
        self.scheduler = build_scheduler(
            config, self.blocks, self.encoder_cache, self.encoder_budget, self.swap, self.states,
            whole_images=self.model.bidirectional_images, device_type=self.device.type,
            sliced_encoding=sliced,
        )  # fmt: skip
        tp = self.parallel
        shared_tower = tp is not None and config.mm_encoder_tp_mode == "data"
        self.runner = ModelRunner(
            self.model, self.kv, self.platform.backend, self.device, self.encoder_cache,
            peers=tp,
            encoder=DataParallelEncoder(self.model, tp) if shared_tower else None,
            threads=rank_threads(config) if tp is not None else None,
            states=self.states,
        )  # fmt: skip
        # The engine's own random stream for unseeded requests: torch's global RNG is the caller's.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.device_lost = False  # set by a step that failed with a device fault
        self.launcher = make_launcher(config, self.runner, self.sampler, self.device)
        if grammars is None or grammars.vocab_size != emb.num_embeddings:  # not the frontend's
            grammars = Grammars.for_config(
                config, lambda: AutoTokenizer.from_pretrained(path), emb.num_embeddings
            )
        self.grammars = grammars
        self._compiling = GrammarWaitlist(self.grammars)  # structured requests, grammar not ready
        self._inflight: Launched | None = None  # the launched step whose tokens are not read yet
        self._carry: list[CoreOutput] = []  # outputs read before a step failed: the next step's
        # A step of background work alone gives way to arrivals (core/background_yield.py): not
        # with async scheduling, nor under TP.
        self.background_yield = config.background_yield and self.launcher is None and self.parallel is None

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
        if params.structured_outputs is not None:  # held back until its grammar is compiled
            if len(self.scheduler.waiting) + len(self._compiling) >= self.config.max_waiting_requests:
                raise QueueFullError(f"queue full: {len(self.scheduler.waiting)} requests are waiting")
            self._compiling.add(req)
        else:
            self.scheduler.add(req)  # may refuse (queue full) before anything is recorded
        self.requests[new.request_id] = req

    def check_fits(self, new: CoreRequest) -> None:
        """Refuse a request that could never run, before it takes anything."""
        ids, spans, params = new.token_ids, new.images, new.params
        self.admission.check(ids, spans, params)
        probe = Request("probe", ids, spans, params, 0.0, -1, frozenset())
        self.blocks.check_fits(probe, min(len(ids) + params.max_tokens, self.max_model_len))

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not self._held_abort(req):
            self._compiling.remove(req)
            self._finish(req, "abort")

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Run one scheduled forward pass; return the new tokens of each request that sampled.
        With async scheduling the tokens returned are those of the step before, and this step's
        forward is still running when it returns (core/launcher.py).

        Raises StepFailedError when the pass fails: the requests it held are dropped (their
        blocks freed), every other request stays as it was."""
        if self.device_lost:
            raise RuntimeError("the device failed earlier; this engine cannot run any more")
        ended = self._admit_compiled() if self._compiling else []  # grammars that failed
        if self.launcher is None:
            ended, self._carry = self._carry + ended, []
        try:
            return ended + (self._step_overlapped() if self.launcher is not None else self._step_plain())
        except StepFailedError:
            self._carry = ended + self._carry  # what was ready goes out with the next step
            raise

    def _step_plain(self) -> list[CoreOutput]:
        batch = self._schedule()
        if not batch.items and not batch.encode_slices:
            return []
        return self._run_batch(batch)

    def _run_batch(self, batch: ScheduledBatch) -> list[CoreOutput]:
        start = time.perf_counter()
        try:  # (a step of image shares alone has no forward: sliced_encoding)
            if not batch.items:
                outputs = self.runner.encode_only(batch)
            elif self._yields(batch):  # it may give way to arrivals (core/background_yield.py)
                outputs, gave_way = self._run_yielding(batch)
                if gave_way:  # (its time is not its own)
                    return outputs
            else:
                outputs = self._run(batch)
        except Exception as exc:
            raise self._failed(exc, [req.request_id for req in batch.requests]) from exc
        self.scheduler.observe_step(batch, time.perf_counter() - start)
        return outputs

    def _admit_compiled(self) -> list[CoreOutput]:
        """Queue the requests whose grammar is compiled; end those whose grammar failed (the
        frontend checked the spec first, so that is unexpected). With nothing else to do, wait a
        little for a compile rather than spin."""
        if not self.scheduler.has_work() and self._inflight is None:
            self._compiling.wait(timeout=0.05)
        ready, failed = self._compiling.take_ready()
        for req in ready:
            try:
                self.scheduler.add(req)
            except QueueFullError as exc:
                failed.append((req, exc))
        ended = []
        for req, exc in failed:
            logger.error("request %s: %s", req.request_id, exc)
            del self.requests[req.request_id]
            self._finish(req, "abort")
            ended.append(
                CoreOutput(req.request_id, [], finish_reason="abort", finished_time=req.finished_time)
            )
        return ended

    def _schedule(self, held: frozenset[str] = frozenset()) -> ScheduledBatch:
        batch = self.scheduler.schedule(time.time(), held)
        for req in batch.preempted:  # recomputed from the start: its image features go too
            self.runner.release(req.request_id)
        return batch

    def _failed(self, exc: Exception, request_ids: list[str]) -> StepFailedError:
        self.device_lost = is_device_fault(exc)
        for rid in request_ids:
            self.abort(rid)
        return StepFailedError(request_ids, self.device_lost)

    def _run(self, batch: ScheduledBatch) -> list[CoreOutput]:
        logits, sampling, prompt_rows = self.runner.execute(batch)
        if prompt_rows:
            prompt_logprobs(batch.items, prompt_rows, logits[len(sampling) :])
            logits = logits[: len(sampling)]
        for req, n in batch.items:
            req.num_computed_tokens += n
            self.blocks.commit(req)
        skip = self._skipped()  # (aborted while this step was paused: they sample nothing)
        if skip:
            keep = [i for i, k in enumerate(sampling) if batch.items[k][0].request_id not in skip]
            logits, sampling = logits[keep], [sampling[i] for i in keep]
        if not sampling:  # only mid-prompt chunks this step
            return []
        reqs = [batch.items[k][0] for k in sampling]
        params, gens = [r.params for r in reqs], [r.generator for r in reqs]
        sampled = self.sampler.sample_tensor(
            logits, params, gens, row_contexts(reqs, self.grammars.vocab_size)
        )
        return self._record(reqs, sampled.ids.tolist(), sampled.host_logprobs(params))

    def _record(
        self, reqs: list[Request], tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[CoreOutput]:
        now = time.time()
        outputs = []
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            outputs.append(self._append(req, token, now, lp))
            if req.finish_reason is not None:
                del self.requests[req.request_id]
        return outputs

    def _append(self, req: Request, token: int, now: float, lp: TokenLogprobs | None) -> CoreOutput:
        out, reason = append_sampled(req, token, now, lp, self.max_model_len)
        if reason is not None:
            self._finish(req, reason, out.stop_token)
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
        # A launched step whose requests have all ended or been aborted has nothing to hand out:
        # the next step reads it (or `close` waits for it).
        return self.scheduler.has_work() or bool(self.requests) or bool(self._carry) or bool(self._compiling)

    def kv_report(self) -> dict[str, dict]:
        return kv_report(self)

    def stats(self) -> dict:
        return core_stats(self)

    def close(self) -> None:
        """Wait for a launched step and stop the launcher's worker (if it has one) and the runner's
        sliced encodes."""
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None
        if self.launcher is not None:
            self.launcher.close()
        self.runner.close()
        if self.parallel is not None:  # the workers stop with us
            self.parallel.close()
