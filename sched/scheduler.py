"""Continuous batching under a token budget, with chunked prefill, priorities and preemption.

Each step walks running and waiting requests together in rank order (the policy's rank; running
requests are ranked once, when admitted, and waiting ones are taken lazily from the waiting queue,
so a step costs what it looks at, not the length of the queue). Decodes come first: before the walk,
one token of the budget is set aside for every running request that is decoding, so better-ranked
prefills (a new image request, image-first) never take a running stream's next token; only
preemption (below) can. With `decode_step_prefill_tokens`, a step that runs decodes adds at most
that many prefill tokens and encodes at most that many image tokens (or one image, whatever its
size), so that how long the running streams wait for their next token stays bounded; with
`sliced_encoding`, an image bigger than that is encoded a share of its tower layers a step, and its
request's chunk waits before it until it is done. With
`step_time_factor` the bound is in time: such a step adds the prefill and encoder work that the
measured step costs (step_costs.py) say keeps it within that factor of its decodes alone (at least
a block of prefill, or one image, so that waiting requests always move).
- a running request gets its next chunk (a decode is one token); when its pool has no block left,
  running requests ranked below it that are not yet scheduled this step are preempted, the fewest
  lowest-ranked ones that free blocks of the pool that is short (victims.py), else it waits itself;
- a waiting request is admitted if a seat (`max_num_seqs`), its blocks (keeping a small watermark
  of free blocks for the running ones) and the budgets allow; if not, it may preempt running
  requests that it outranks by the policy's margin, when they together free enough. Waiting
  requests never overtake each other, with one exception: a request whose next prompt block is
  being computed in this step by one ranked above it (the second question about an image that the
  first is prefilling) waits a step, so that it reuses those blocks instead of computing them
  again, and lets the ones behind it go ahead.
Background work (batch requests, ranked after everything else) gets no set-aside token, and after
foreground work in a step at most `background_step_tokens` (default 0: only steps without any);
a step of background work alone adds at most `background_prefill_tokens` of prefill, or encodes one
image with the prompt up to its first token (the image's run is prefilled in a later step), so that a
request arriving meanwhile waits for a short step, not for an encode and a prefill in one (and the
core may pause such a step for it: `schedule(held=...)` then leaves that step's requests alone).
A chunk also stops before an image that the per-step encoder budget cannot encode, and, with
`whole_images` (Gemma 3: an image's tokens attend to each other in both directions, so all its keys
must be written before any of its queries runs), before an image it would otherwise split.
"""

from __future__ import annotations

import itertools
import math

from mm_engine.pools.block_manager import IMAGE, BlockManager
from mm_engine.pools.state_pool import StatePool
from mm_engine.pools.swap import HostSwap
from mm_engine.request import Request, Status
from mm_engine.sched.batch import ScheduledBatch
from mm_engine.sched.chunks import next_chunk
from mm_engine.sched.policy import BACKGROUND, Policy, outranks
from mm_engine.sched.step_costs import StepCosts, StepShape
from mm_engine.sched.step_pass import StepPass
from mm_engine.sched.victims import choose_victims
from mm_engine.sched.waiting_queue import WaitingQueue
from mm_engine.vision.encoder_cache import EncoderCache


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`: try again later."""


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        policy: Policy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        encoder_cache: EncoderCache,
        encoder_budget: int,
        swap: HostSwap | None = None,
        max_waiting_requests: int = 10_000,
        whole_images: bool = False,
        decode_first: bool = True,
        decode_step_prefill_tokens: int | None = None,
        states: StatePool | None = None,
        step_time_factor: float | None = None,
        background_step_tokens: int = 0,
        background_prefill_tokens: int = 256,
        sliced_encoding: bool = False,
    ) -> None:
        """`states`: a hybrid model's recurrent-state pool; every running request holds a slot,
        so at most `min(max_num_seqs, slots)` run at once."""
        self.blocks = blocks
        self.states = states
        self.policy = policy
        self.max_num_seqs = max_num_seqs if states is None else min(max_num_seqs, states.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.encoder_cache = encoder_cache
        self.encoder_budget = encoder_budget
        self.swap = swap  # None: preemption recomputes
        self.max_waiting_requests = max_waiting_requests
        self.whole_images = whole_images
        self.decode_first = decode_first
        self.decode_step_prefill_tokens = decode_step_prefill_tokens
        self.step_time_factor = step_time_factor
        self.background_step_tokens = background_step_tokens
        self.background_prefill_tokens = background_prefill_tokens
        self.sliced_encoding = sliced_encoding
        self.costs = StepCosts()  # learned from `observe_step`; used with `step_time_factor`
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []  # in rank order at the start of each step
        self._ranks: dict[str, tuple] = {}  # running request id -> its rank (fixed once admitted)
        self.num_preemptions = 0
        self.preemptions_by_pool = {"text": 0, "image": 0}
        # Per request, the image its last chunk ended inside: its features are held by the runner
        # from that step on, so the next chunk does not charge the encoder budget for it again.
        self._straddling: dict[str, int] = {}

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting_requests:
            raise QueueFullError(f"queue full: {len(self.waiting)} requests are waiting; try again later")
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, now: float, held: frozenset[str] = frozenset()) -> ScheduledBatch:
        """The next step's batch. `held`: the requests of a paused step of background work alone
        (core/background_yield.py), whose blocks it is still writing: this step never schedules or
        preempts them, and no background work runs in it."""
        batch = ScheduledBatch()
        p = StepPass(batch, self.max_num_batched_tokens, self.encoder_budget, slicing=self.sliced_encoding)
        p.held = held
        ranks = self._ranks
        self.running.sort(key=lambda r: ranks[r.request_id])  # ranked once, when admitted
        running = list(self.running)
        if self.decode_first:  # (background work, ranked last, takes what foreground work leaves)
            p.set_aside(itertools.takewhile(lambda r: ranks[r.request_id][0] != BACKGROUND, running))
        # (Not for whole images: one must fit a step whole, and a cap below it would stall it.)
        if p.reserved and not self.whole_images:
            self._cap_for_decodes(p)
        waiting = self.waiting.in_rank_order(now)
        try:
            nxt = next(waiting, None)
            nxt_rank = None if nxt is None else self.policy.rank(nxt, now)
            i = 0
            while (p.budget > 0 or p.reserved) and (i < len(running) or nxt is not None):
                if i < len(running) and running[i].request_id in p.preempted:
                    i += 1  # preempted earlier in this step: it waits at least one step
                    continue
                take_waiting = nxt is not None and (
                    i == len(running) or nxt_rank < ranks[running[i].request_id]
                )
                rank = nxt_rank if take_waiting else ranks[running[i].request_id]
                if rank[0] == BACKGROUND and not p.background:
                    if held:  # the paused step resumes once foreground work leaves it a step
                        break
                    p.enter_background(
                        self.background_step_tokens, self.background_prefill_tokens, running[i:]
                    )
                if take_waiting:
                    if nxt.request_id in p.preempted or self._admit(nxt, nxt_rank, now, p):
                        nxt = next(waiting, None)
                        nxt_rank = None if nxt is None else self.policy.rank(nxt, now)
                    else:
                        nxt = None  # waiting requests never overtake each other
                        # (Its seat or blocks may be the paused step's: that step ends next.)
                        batch.held_in_way = bool(held)
                    continue
                released = p.release(running[i].request_id)  # its set-aside token, to take now
                self._schedule_running(running[i], p)
                if released and running[i].request_id not in p.scheduled:
                    p.budget = max(0, p.budget - 1)  # not taken (it gave way): not a prefill's either
                i += 1
        finally:
            waiting.close()  # what was looked at but stays waiting goes back into the queue
            batch.copies = self.blocks.take_copies()  # the partial prompt blocks copied on admission
        return batch

    def _cap_for_decodes(self, p: StepPass) -> None:
        """Bound the prefill and encoder work a step with running decodes adds (module docstring)."""
        costs = self.costs.fitted() if self.step_time_factor is not None else None
        cap, factor = self.decode_step_prefill_tokens, self.step_time_factor
        p.cap_for_decodes(cap, costs, factor, self.blocks.block_size)

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """How long a batch this scheduler made took to run (the step-time bound learns from it)."""
        decodes = batch.num_decodes
        self.costs.observe(StepShape(decodes, batch.num_tokens - decodes, batch.encoder_tokens), seconds)

    def _chunk(self, req: Request, p: StepPass) -> tuple[int, int]:
        held = self._straddling.get(req.request_id)
        return next_chunk(req, p, self.whole_images, held, self.encoder_cache)

    def _take(self, req: Request, n: int, cost: int, p: StepPass) -> None:
        batch = p.batch
        batch.items.append((req, n))
        # (Encoding may spend more than is left: one image always goes. Never below zero.)
        p.budget = max(0, p.budget - n - math.ceil(cost * p.encode_weight))
        p.encoder_left -= cost
        batch.encoder_tokens += cost
        if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
            batch.num_decodes += 1
        p.one_image_free = p.one_image_free and cost == 0
        p.scheduled.add(req.request_id)
        if req.num_computed_tokens >= req.num_prompt_tokens:  # a decode: past every image
            return
        p.prefilled += n
        if p.encode_alone and cost:
            p.budget = 0  # the image is this step's prompt work; decodes keep their set-aside tokens
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if self.states is not None:
            snaps = self.blocks.plan_snapshots(req, start, end)
            if snaps:
                batch.state_snapshots[req.request_id] = snaps
        held = self._straddling.pop(req.request_id, None)
        for j, span in enumerate(req.images):
            if span.offset >= end or span.offset + span.length <= start:
                continue
            if j != held:
                batch.new_images.append((req, j))
            if span.offset + span.length <= end:
                batch.passed_images.append((req.request_id, j))
            else:  # the chunk ends inside it: its features stay with the runner until it is passed
                self._straddling[req.request_id] = j
        p.in_flight.update(self.blocks.pending_prompt_hashes(req))

    def _schedule_running(self, req: Request, p: StepPass) -> None:
        n, cost = self._chunk(req, p)
        if n == 0:
            return
        if not self.blocks.allocate(req, n):
            # Only requests ranked below it may give way; if they cannot free enough, it waits.
            below = self._candidates(p, stop_at=req)
            victims = choose_victims(self.blocks, self.blocks.shortfall(req, n), 0, below)
            for victim in victims or [req]:
                self.preempt(victim, p)
            if victims is None or not self.blocks.allocate(req, n):
                if req in self.running:
                    self.preempt(req, p)
                return
        self._take(req, n, cost, p)

    def _candidates(self, p: StepPass, stop_at: Request | None = None, outranked_by: tuple | None = None):
        """Running requests not yet scheduled this step, lowest rank first, down to `stop_at` (or
        while `outranked_by` outranks them)."""
        for r in reversed(self.running):
            if r is stop_at:
                return
            if r.request_id in p.scheduled or r.request_id in p.held:
                continue
            rank = self._ranks[r.request_id]
            if outranked_by is not None and not outranks(self.policy, outranked_by, rank):
                return
            yield r

    def _admit(self, req: Request, rank: tuple, now: float, p: StepPass) -> bool:
        """Admit `req` if it fits; returns whether the requests behind it may still be admitted."""
        swapped = self.swap is not None and self.swap.has(req.request_id)
        cached = 0
        if swapped:  # resume where it stopped; blocks are allocated fresh and the KV copied back
            req.num_computed_tokens = self.swap.num_computed(req.request_id)
        else:
            # A request blocked at the head of the queue is probed every step: its lookup is
            # counted once, when it is admitted (below).
            cached = self.blocks.match_prefix(req, count=False)
            if self.blocks.next_block_hash(req) in p.in_flight:
                self.blocks.free(req)  # its prefix blocks stay cached for next step
                req.num_computed_tokens = 0
                return True
        n, cost = self._chunk(req, p)
        # While it preempts to make room, its own swapped KV must stay (swap_out may drop text KV).
        p.admitting = req.request_id if swapped else None
        if n > 0:
            short = self.blocks.shortfall(req, n, keep_watermark=True)
            seats = len(self.running) + 1 - self.max_num_seqs
            victims = choose_victims(self.blocks, short, seats, self._candidates(p, outranked_by=rank))
            for victim in victims or []:
                self.preempt(victim, p)
            if victims is None or not self.blocks.can_allocate(req, n, keep_watermark=True):
                n = 0
        p.admitting = None
        if n == 0:
            self.blocks.free(req)  # give back any prefix blocks taken; they stay cached
            req.num_computed_tokens = 0
            return False
        self.blocks.allocate(req, n)
        if self.states is not None:
            self.states.allocate(req)
            row = None if swapped else self.blocks.restore_row(req)
            if row is not None:
                p.batch.state_copies.append((row, req.state_slot))
        if swapped:
            self.swap.swap_in(req.request_id, req.block_table, req.state_slot)
        if not swapped:
            self.blocks.count_lookup(req, cached // self.blocks.block_size)
        self.waiting.remove(req)
        self.running.append(req)
        self._ranks[req.request_id] = rank  # fixed from now on: its wait stopped counting
        req.status = Status.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
            req.num_cached_tokens = cached
        self._take(req, n, cost, p)
        return True

    # ---- leaving the batch ---------------------------------------------------------------------

    def preempt(self, req: Request, p: StepPass | None = None) -> None:
        """Free a running request's blocks (swapping its KV to host if asked) and make it wait;
        within a `schedule()` pass `p`, it waits at least until the next step."""
        self.running.remove(req)
        del self._ranks[req.request_id]
        bs = self.blocks.block_size
        held = req.block_table[: -(-req.num_computed_tokens // bs)]
        image_pool = self.blocks.pools[IMAGE]
        has_image = any(b in image_pool for b in held)
        for pool in {"image" if b in image_pool else "text" for b in held}:
            self.preemptions_by_pool[pool] += 1
        if self.swap is not None and held:
            self.swap.swap_out(
                req.request_id, held, req.num_computed_tokens, has_image, protect=p.admitting if p else None,
                state_slot=req.state_slot,
            )  # fmt: skip
        self.blocks.free(req)
        if self.states is not None:
            self.states.free(req)
        req.num_computed_tokens = 0
        self._straddling.pop(req.request_id, None)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.add(req)
        if p is not None:
            p.reserved.discard(req.request_id)  # its token is not spent this step (nor handed on)
            p.preempted.add(req.request_id)
            p.batch.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request from whichever queue holds it, freeing its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            del self._ranks[req.request_id]
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if self.swap is not None:
            self.swap.drop(req.request_id)
        self.blocks.free(req)
        if self.states is not None:
            self.states.free(req)
        self.blocks.forget(req)
        self._straddling.pop(req.request_id, None)
        req.status = Status.FINISHED
