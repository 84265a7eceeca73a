"""The working state of one `Scheduler.schedule()` call (sched/scheduler.py): the step's batch
as it grows, the token and encoder budgets left, and what was scheduled, preempted or set aside."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from mm_engine.request import Request
from mm_engine.sched.batch import ScheduledBatch
from mm_engine.sched.step_costs import Costs


@dataclass(slots=True)
class StepPass:
    """One `schedule()` call's working state; it ends with the call."""

    batch: ScheduledBatch
    budget: int  # tokens left this step
    encoder_left: int  # image tokens the tower may still encode this step
    scheduled: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)  # preempted in this step: they wait at least one
    # Prompt blocks that requests scheduled so far in this step are computing: a waiting request
    # (ranked below them) about to compute the same block waits for it to land in the prefix cache.
    in_flight: set[bytes] = field(default_factory=set)
    admitting: str | None = None  # a swapped request being admitted (see _admit)
    reserved: set[str] = field(default_factory=set)  # decodes whose token is set aside, not yet taken
    one_image_free: bool = False  # a capped step still encodes one image (or, slicing, a share of it)
    encode_weight: float = 0.0  # budget tokens one encoded image token takes (a time-bounded step)
    background: bool = False  # the walk has reached background work (the rest of it is too)
    # A step of background work alone: an image it encodes is the only prompt work it does (see
    # enter_background); `prefilled` counts the prompt tokens taken so far this step.
    encode_alone: bool = False
    prefilled: int = 0
    # Whether an image too big for what is left may be encoded a share at a time (sliced_encoding),
    # and the images given a share this step (by content hash: one share a step, whoever asks).
    slicing: bool = False
    sliced: set[str] = field(default_factory=set)
    held: frozenset[str] = frozenset()  # a paused step's requests: never scheduled nor preempted

    def release(self, request_id: str) -> bool:
        """Give a decode's set-aside token back to the budget, for it to take now."""
        if request_id in self.reserved:
            self.reserved.discard(request_id)
            self.budget += 1
            return True
        return False

    def slice_image(self, req: Request, j: int, tokens: int) -> None:
        """Encode a share of image `j`'s tower this step, charged as `tokens` image tokens (at least
        one layer's worth is run whatever `tokens` says): it takes the place of the one image a
        capped step may encode whole."""
        tokens = max(1, tokens)
        self.sliced.add(req.images[j].content_hash)
        self.batch.encode_slices.append((req, j, tokens))
        self.batch.encoder_tokens += tokens
        self.encoder_left -= tokens
        self.budget = 0 if self.encode_alone else max(0, self.budget - math.ceil(tokens * self.encode_weight))
        self.one_image_free = False

    def cap_for_decodes(
        self, cap: int | None, costs: Costs | None, factor: float | None, block_size: int
    ) -> None:
        """Bound the prefill and encoder work a step with running decodes adds: at most `cap`
        tokens, and with fitted step `costs` what keeps the step within `factor` of its decodes
        alone (at least a block of prefill)."""
        enc = self.encoder_left
        if costs is not None and costs.per_prefill > 0.0:
            timed, timed_enc, self.encode_weight = costs.allowance(len(self.reserved), factor)
            timed = max(block_size, timed)
            cap = timed if cap is None else min(cap, timed)
            enc = enc if timed_enc is None else timed_enc
            # Encoding is weighed against the time left even where the token cap does not bind:
            # one image still goes, or an image request would wait as long as anything decodes.
            self.one_image_free = self.encode_weight > 0.0
        if cap is not None and cap < self.budget:
            self.budget, self.encoder_left, self.one_image_free = cap, min(self.encoder_left, cap, enc), True

    def set_aside(self, requests: Iterable[Request]) -> None:
        """One token of the budget for each of `requests` that is decoding, while the budget lasts."""
        taken = 0
        for req in requests:
            if taken < self.budget and req.num_tokens - req.num_computed_tokens == 1:
                self.reserved.add(req.request_id)
                taken += 1
        self.budget -= taken

    def enter_background(self, tokens: int, prefill_tokens: int, requests: Iterable[Request]) -> None:
        """The walk reached background work (batch requests, ranked after all else). After
        foreground work in this step it gets at most `tokens`, so that it never lengthens a step
        interactive streams wait on. In a step of background work only, each of its decoding `requests` gets
        its token and prefill gets at most `prefill_tokens`, or one image is encoded with at most the
        prompt up to its first token (the rest of the image's run goes in a later step, from the
        features the runner holds): a request that arrives meanwhile waits for one short step, not
        for a batch's image to be encoded and prefilled in one."""
        self.background = True
        if self.scheduled:
            self.budget = min(self.budget, tokens)
            self.encoder_left = min(self.encoder_left, tokens)
            self.one_image_free = False
            return
        self.batch.background_only = True
        self.encode_alone = True
        self.set_aside(requests)
        self.budget = min(self.budget, prefill_tokens)
        self.encoder_left = min(self.encoder_left, prefill_tokens)
        self.one_image_free = True
