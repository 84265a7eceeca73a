"""Continuous batching under a token budget, with chunked prefill.

Each step the running requests go first (a decode costs one token, an unfinished prefill takes
what budget is left as its next chunk), then waiting requests are admitted in rank order while the
budget, `max_num_seqs` and free blocks allow. When a running request cannot get a block, the
lowest-ranked running request is preempted: its blocks are freed and it waits again, keeping its
rank and arrival, to be recomputed later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_engine.pools.block_manager import BlockManager
from mm_engine.request import Request, Status
from mm_engine.sched.policy import Policy


@dataclass(slots=True)
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, policy: Policy, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = blocks
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0  # in all, for reports and tests

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        rank = lambda r: self.policy.rank(r, now)  # noqa: E731
        self.running.sort(key=rank)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, batch):
                break  # `req` itself was the lowest-ranked and got preempted
            batch.items.append((req, n))
            budget -= n
            i += 1
        if batch.preempted:
            return batch  # memory is short: admitting anyone now would only thrash
        self.waiting.sort(key=rank)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.blocks.allocate(req, n):
                break  # strict rank order: nobody overtakes the head of the queue
            self.waiting.pop(0)
            self.running.append(req)
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            batch.items.append((req, n))
            budget -= n
        return batch

    def _allocate_or_preempt(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        while not self.blocks.allocate(req, n):
            victim = self.running.pop()  # ranked last; everything before `req` is already scheduled
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Recompute-mode preemption: drop the KV, keep the tokens, wait again."""
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.image_embeds.clear()
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request from whichever queue holds it, freeing its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req)
        self.blocks.forget(req)
        req.image_embeds.clear()
        req.status = Status.FINISHED
