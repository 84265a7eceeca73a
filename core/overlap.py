"""Async scheduling: the engine core's step while the forward runs behind the host.

    step N+1:  schedule -> prepare, launch (the forward starts) -> read step N's tokens -> settle N+1

(A step N of background work alone is read first, and step N+1 scheduled in the call after: a
request that arrives while it runs must not wait behind a step N+1 scheduled without it.)

The scheduler sees each request of step N as if its token were there (a `PLACEHOLDER` counts), so
the batches are those of the plain loop, except that a request ending on an EOS token is found
out one step late: it takes a seat in one more batch, whose token is dropped. Requests that end by
length are known in advance and leave on time. KV blocks freed meanwhile (by an abort, a finish, a
preemption) are written by the forward still in flight only where nobody reads them, and reused
only by later forwards, which run after it (on the CUDA stream, or on the launcher's one worker).
"""

from __future__ import annotations

import time

from mm_engine.core.faults import StepFailedError
from mm_engine.core.launcher import Launched
from mm_engine.core.logit_adjust import row_contexts
from mm_engine.core.model_runner import PLACEHOLDER
from mm_engine.core.types import CoreOutput
from mm_engine.sched.scheduler import ScheduledBatch


class OverlappedSteps:
    """EngineCore's overlapped step (the launcher, the scheduler, the runner are the core's)."""

    def _step_overlapped(self) -> list[CoreOutput]:
        """One overlapped step; returns the outputs of the step before. A step that fails is
        found out where its tokens are read: with it fails the step launched on its tokens. Any
        failure fails the requests of both steps that are still live, and keeps the outputs read
        so far for the next step."""
        prev, self._inflight = self._inflight, None
        outputs, self._carry = self._carry, []
        batch = ScheduledBatch()
        start = time.perf_counter()
        try:
            outputs = self._overlapped(prev, batch, outputs)
            # The call's wall time stands for this batch's: in steady state it is what one step
            # of the pipeline takes (this batch prepared while the one before computes).
            if batch.items:
                self.scheduler.observe_step(batch, time.perf_counter() - start)
            return outputs
        except StepFailedError:
            raise
        except Exception as exc:  # outside the guarded parts (scheduling, settling): fail both steps
            raise self._fail(exc, [*(prev.items if prev else []), *batch.items], outputs) from exc

    def _overlapped(self, prev: Launched | None, batch: ScheduledBatch, outputs: list[CoreOutput]):
        """schedule -> launch this step -> collect the previous one's tokens -> settle this one."""
        if prev is not None and prev.background_only:
            # Read before the next step is scheduled: a request that arrived while background work
            # alone ran then goes into the very next step, not behind one more (background work
            # gives up the overlap for that).
            return self._collect_before(prev, batch, outputs)
        if prev is not None and self.launcher.concurrent and self.swap is not None:
            prev.wait()  # swapping copies KV blocks on this thread: the forward must not be writing them
        scheduled = self._schedule()  # into the caller's batch: what fails if anything does
        batch.adopt(scheduled)
        if any(r.params.prompt_logprobs is not None and r.first_token_time is None for r, _ in batch.items):
            return self._plain_after(prev, batch, outputs)
        if prev is not None and self._reads_pending(prev, batch):
            # A penalty or a grammar reads the tokens so far: the previous step's come first.
            prev, outputs = None, self._collect_before(prev, batch, outputs)
        launched, error, failed = None, None, [(req, 0) for req in batch.requests]
        try:
            if batch.items:
                launched = self._launch(batch, prev)
            elif batch.encode_slices:  # shares of images only: run here, no forward to launch
                self.runner.encode_only(batch)
        except Exception as exc:
            error = exc
        if prev is not None:
            try:
                outputs += self._collect(prev)
            except Exception as exc:  # the previous forward failed: this one ran on its tokens
                if launched is not None:
                    launched.wait()
                self._forget_registered(prev)
                failed, error = [*prev.items, *batch.items], exc
        if error is not None:
            raise self._fail(error, failed, outputs) from error
        self._inflight = launched
        if launched is not None:
            self._settle(launched)
        return outputs

    def _plain_after(self, prev: Launched | None, batch: ScheduledBatch, outputs: list[CoreOutput]):
        """Prompt logprobs come from the plain step (its logits have extra rows): the step in
        flight is read first, then this one runs without overlap."""
        if prev is not None:
            outputs = self._collect_before(prev, batch, outputs)
        if not batch.items:
            return outputs
        try:
            return outputs + self._run(batch)
        except Exception as exc:
            raise self._fail(exc, batch.items, outputs) from exc

    @staticmethod
    def _reads_pending(prev: Launched, batch: ScheduledBatch) -> bool:
        """Whether a request whose sampling reads its tokens so far has one still in flight."""
        readers = {req.request_id for req, _ in batch.items if req.params.needs_history}
        return bool(readers) and any(prev.items[k][0].request_id in readers for k in prev.sampling)

    def _fail(self, exc: Exception, items: list, outputs: list[CoreOutput]) -> StepFailedError:
        """The one place a failed overlapped step is accounted for: the requests of `items` still
        live fail (not those that ended with the outputs just read); the outputs read so far of
        every other request are handed out with the next step."""
        ids = [rid for rid in dict.fromkeys(req.request_id for req, _ in items) if rid in self.requests]
        self._carry = [o for o in outputs if o.request_id not in ids]
        return self._failed(exc, ids)

    def _forget_registered(self, step: Launched) -> None:
        """A step whose forward failed wrote no KV: the blocks it registered for reuse must go."""
        for req, before in step.registered:
            self.blocks.uncommit(req, before)

    def _collect_before(self, prev: Launched, batch: ScheduledBatch, outputs: list[CoreOutput]):
        """Read the step in flight before this one launches; drop the requests it ended."""
        try:
            outputs = outputs + self._collect(prev)
        except Exception as exc:
            self._forget_registered(prev)
            raise self._fail(exc, [*prev.items, *batch.items], outputs) from exc
        batch.drop_finished()
        return outputs

    def _launch(self, batch: ScheduledBatch, prev: Launched | None) -> Launched:
        pending = (
            {} if prev is None else {prev.items[k][0].request_id: i for i, k in enumerate(prev.sampling)}
        )
        inputs = self.runner.prepare(batch, pending)
        sampling = [batch.items[k][0] for k in inputs.sampling]
        params, gens = [r.params for r in sampling], [r.generator for r in sampling]
        launched = self.launcher.launch(
            batch.items, inputs, params, gens, prev, row_contexts(sampling, self.grammars.vocab_size)
        )
        launched.background_only = batch.background_only
        return launched

    def _collect(self, step: Launched) -> list[CoreOutput]:
        """The tokens a launched step sampled, in place of its requests' placeholders."""
        tokens = step.token_ids()
        logprobs = step.logprobs()
        live = []
        for k, token, lp in zip(step.sampling, tokens, logprobs, strict=True):
            req = step.items[k][0]
            if self.requests.get(req.request_id) is req:  # else aborted meanwhile, or a stale row
                req.token_ids.pop()  # its PLACEHOLDER, always the last
                live.append((req, token, lp))
        return self._record([r for r, _, _ in live], [t for _, t, _ in live], [lp for *_, lp in live])

    def _settle(self, step: Launched) -> None:
        """Once a launched step's inputs are all known: advance its requests, register their full
        blocks, and hold a placeholder for each token it samples. A request whose sample will be
        its last by length leaves the scheduler now; its output comes with that token."""
        for req, n in step.items:
            if req.is_finished:  # ended on the previous step's token: this row is stale
                continue
            req.num_computed_tokens += n
            before = req.num_registered_blocks
            if self.blocks.commit(req):  # to forget if the forward turns out to have failed
                step.registered.append((req, before))
        for k in step.sampling:
            req = step.items[k][0]
            if req.is_finished:
                continue
            req.token_ids.append(PLACEHOLDER)
            if (
                req.num_tokens - req.num_prompt_tokens >= req.params.max_tokens
                or req.num_tokens >= self.max_model_len
            ):
                self.scheduler.finish(req)
                self.runner.release(req.request_id)
