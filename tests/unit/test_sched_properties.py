"""Stateful property test of the pools and the scheduler, without a model.

Random arrivals (text and image requests, repeated prompts and images for cache hits), aborts and
steps of a fake clock drive the real scheduler, block manager, prefix cache, swap space and encoder
cache; a fake runner stands in for the model. After every rule the bookkeeping must add up, and
every running request's KV slots must hold what it computed: the fake runner writes each token's
id and position into its K slot, after the step's block copies, so a block shared, copied or swapped
wrongly shows up as a slot with someone else's token.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.pools.hybrid_blocks import HybridBlockManager
from mm_engine.pools.kv_cache import KVCache, KVCacheSpec
from mm_engine.pools.state_pool import StatePool, StateSpec
from mm_engine.pools.state_snapshots import StateSnapshots
from mm_engine.pools.swap import HostSwap
from mm_engine.request import ImageSpan, Request, Status
from mm_engine.sampling_params import SamplingParams
from mm_engine.sched.policy import PriorityPolicy, is_background
from mm_engine.sched.scheduler import Scheduler
from mm_engine.vision.encoder_cache import EncoderCache

BS = 4
IMG_TOKENS = 6
IMAGE_ID = 99
MAX_WAIT = 5.0
ARRIVALS = {  # a request's draws (priority 2: background work)
    "n_images": st.integers(0, 2),
    "image_seed": st.integers(0, 2),
    "words": st.lists(st.integers(1, 5), min_size=1, max_size=6),
    "max_tokens": st.integers(1, 6),
    "priority": st.integers(0, 2),
}


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        mode=st.sampled_from(["recompute", "swap"]),
        n_text=st.integers(8, 20),
        n_image=st.integers(4, 10),
        max_seqs=st.integers(1, 4),
        budget=st.integers(4, 24),
        cap=st.sampled_from([None, 1, 3, 8]),
        snapshots=st.sampled_from([None, 0, 1, 3, 8]),
        factor=st.sampled_from([None, 1.5, 3.0]),
        sliced=st.booleans(),
        yielding=st.booleans(),
    )
    def setup(
        self, mode, n_text, n_image, max_seqs, budget, cap, snapshots, factor, sliced=False, yielding=False
    ):
        """`snapshots`: None for a plain model; else a hybrid one with a state slot per seat and
        that many snapshot rows (0: no prefix reuse). `factor`: steps bounded in time, each step
        reported to take a made-up linear time. `sliced`: an image too big for a capped step is
        encoded a share a step (the fake runner counts the shares). `yielding`: a step of background
        work alone pauses halfway through its forward (core/background_yield.py) and the following
        steps run beside it, holding its requests, until one finds no foreground work."""
        spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)
        self.kv = KVCache(spec, n_text + n_image, torch.device("cpu"))
        pools = BlockPool(TEXT, 0, n_text), BlockPool(IMAGE, n_text, n_image)
        self.states = None
        if snapshots is None:
            self.blocks = BlockManager(*pools, BS, True, 0.05)
        else:
            state_spec = StateSpec(1, 1, 2, 1, 1, 1, torch.float32)
            self.states = StatePool(state_spec, max_seqs, torch.device("cpu"), snapshots)
            if snapshots:
                self.blocks = HybridBlockManager(*pools, BS, StateSnapshots(self.states.snapshot_rows), 0.05)
            else:
                self.blocks = BlockManager(*pools, BS, False, 0.05)
        self.encoder_cache = EncoderCache(capacity_bytes=2 * IMG_TOKENS * 4)
        swap = HostSwap(self.kv, 6 * spec.bytes_per_block, states=self.states) if mode == "swap" else None
        # Priority 2 is background work (Batch API requests: only in steps without foreground work).
        self.policy = PriorityPolicy(
            image_priority_boost=0.5, max_wait_s=MAX_WAIT, preemption_margin=1.0, background_priority=2
        )
        self.sched = Scheduler(
            self.blocks,
            self.policy,
            max_seqs,
            budget,
            self.encoder_cache,
            IMG_TOKENS,
            swap,
            max_waiting_requests=50,
            decode_step_prefill_tokens=cap,
            states=self.states,
            step_time_factor=factor,
            sliced_encoding=sliced,
        )
        self.slices: dict[str, tuple[str, int]] = {}  # image hash -> (owner, image tokens encoded)
        self.cap = cap
        self.budget = budget
        self.now = 0.0
        self.seq = 0
        self.live: dict[str, Request] = {}
        self.held: set[tuple[str, int]] = set()  # image features the runner holds between steps
        self.yielding = yielding
        self.paused = None  # a step of background work alone, paused halfway through its forward
        self.paused_in_way = False
        self.aborted: set[str] = set()  # held requests aborted meanwhile: they end when it does

    # ---- rules -------------------------------------------------------------------------------

    @rule(**ARRIVALS)
    def arrive(self, n_images, image_seed, words, max_tokens, priority):
        ids: list[int] = [1]
        spans = []
        for k in range(n_images):
            spans.append(ImageSpan(len(ids), IMG_TOKENS, torch.zeros(1), f"img{image_seed + k}"))
            ids += [IMAGE_ID] * IMG_TOKENS
        ids += words
        req = Request(
            str(self.seq), ids, spans, SamplingParams(max_tokens=max_tokens), self.now, self.seq, frozenset(),
            priority=priority,
        )  # fmt: skip
        need = self.blocks.blocks_needed(req, len(ids) + max_tokens)
        if any(n > self.blocks.pools[p].num_blocks * 0.9 for p, n in need.items()):
            return  # the engine refuses what could never fit; see test_request_that_can_never_fit
        self.seq += 1
        self.sched.add(req)
        self.live[req.request_id] = req

    @precondition(lambda self: self.paused is not None)
    @rule(**{**ARRIVALS, "priority": st.integers(0, 1)})
    def arrive_while_paused(self, n_images, image_seed, words, max_tokens, priority):
        """Foreground work arriving while a step of background work is paused (what pauses it)."""
        self.arrive(n_images, image_seed, words, max_tokens, priority)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.paused is not None and rid in self._held():
            self.aborted.add(rid)  # the paused forward still writes its blocks: it ends with it
        else:
            self._finish(rid)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def step(self, dt):
        self.now += dt
        bg = self.policy.background_priority
        if self.paused_in_way:  # a request waits for the paused step's seats or blocks: it ends first
            self._resume()
            return
        decoding = [
            r.request_id for r in self.sched.running
            if r.num_tokens - r.num_computed_tokens == 1 and not is_background(r, bg)
        ]  # fmt: skip
        held = self._held()
        batch = self.sched.schedule(self.now, held)
        if held:  # beside a paused step: foreground work only, its requests left alone
            assert not held & {r.request_id for r in batch.requests}, "a held request scheduled"
            assert not held & {r.request_id for r in batch.preempted}, "a held request preempted"
            assert not any(is_background(r, bg) for r in batch.requests), "background work beside it"
            self.paused_in_way = batch.held_in_way
            if not batch.items and not batch.encode_slices:
                self._resume()
                return
        if not batch.background_only:  # background work only goes in steps without foreground work
            assert not any(is_background(r, bg) for r, _ in batch.items)
        assert all(n > 0 for _, n in batch.items), "a request scheduled with no tokens to compute"
        decodes = [r for r, n in batch.items if n == 1 and r.num_computed_tokens >= r.num_prompt_tokens]
        assert batch.num_decodes == len(decodes)
        charged = [req.images[j] for req, j in batch.new_images]  # (the fake runner fills the cache later)
        shares = [(req.images[j].content_hash, tokens) for req, j, tokens in batch.encode_slices]
        assert len({h for h, _ in shares}) == len(shares), "an image given two shares in one step"
        assert not any(self.encoder_cache.contains(h) for h, _ in shares), "a share of an encoded image"
        assert batch.encoder_tokens == sum(
            s.num_embeds for s in charged if not self.encoder_cache.contains(s.content_hash)
        ) + sum(t for _, t in shares)
        if len(decoding) <= self.budget:  # decodes first: each gets its token unless preempted
            given = {r.request_id for r, _ in batch.items} | {r.request_id for r in batch.preempted}
            assert set(decoding) <= given, "a running decode got no token"
            if decoding and self.cap is not None:  # and the prefills beside them stay under the cap
                prefill = sum(n for r, n in batch.items if r.request_id not in decoding)
                assert prefill <= self.cap, f"{prefill} prefill tokens beside decodes, cap {self.cap}"
        ranks = {r.request_id: self.policy.rank(r, self.now) for r in self.live.values()}
        scheduled = {r.request_id for r in batch.requests}  # (a share of an image's tower serves one too)
        for w in self.sched.waiting:
            if ranks[w.request_id][0] == 0 and w.request_id not in scheduled and not batch.held_in_way:
                # starved: only requests ranked above it may run instead
                assert any(ranks[s] < ranks[w.request_id] for s in scheduled), (
                    "a starved request was passed over"
                )
        self._check_image_features(batch)
        self._fake_slices(batch)
        if batch.copies:  # the runner copies partial prompt blocks before the forward writes
            src, dst = (torch.tensor(x) for x in zip(*batch.copies, strict=True))
            self.kv.copy_blocks(src, dst)
        if batch.state_copies:  # and snapshots into the slots of requests that reuse a prefix
            src, dst = (torch.tensor(x) for x in zip(*batch.state_copies, strict=True))
            self.states.copy_rows(src, dst)
        if self.yielding and batch.background_only and batch.items:
            for req, n in batch.items:  # its first layers' KV is written; the rest when it resumes
                self._fake_kv(req, req.num_computed_tokens, req.num_computed_tokens + n)
            self.paused = batch
            return
        self._finish_step(batch)

    def _held(self) -> frozenset[str]:
        return frozenset() if self.paused is None else frozenset(r.request_id for r in self.paused.requests)

    def _resume(self) -> None:
        """The paused step runs to its end; the requests aborted meanwhile end with it."""
        batch, self.paused, self.paused_in_way = self.paused, None, False
        self._finish_step(batch)
        for rid in sorted(self.aborted):
            if rid in self.live:
                self._finish(rid)
        self.aborted.clear()

    def _finish_step(self, batch) -> None:
        """The rest of a step: the forward's writes, tokens sampled, requests that end."""
        for req, n in batch.items:
            if self.states is not None:
                self._fake_state(req, n, batch.state_snapshots.get(req.request_id, []))
            self._fake_run(req, n)
            assert req.num_computed_tokens <= req.num_tokens
            self.blocks.commit(req)
            if req.num_computed_tokens == req.num_tokens and req.request_id not in self.aborted:
                req.token_ids.append(7 + len(req.token_ids) % 3)  # a made-up sampled token
                if len(req.output_token_ids) >= req.params.max_tokens:
                    self._finish(req.request_id)
        prefill = batch.num_tokens - batch.num_decodes
        self.sched.observe_step(
            batch, 0.01 + 0.002 * batch.num_decodes + 0.001 * prefill + 0.003 * batch.encoder_tokens
        )

    def _finish(self, rid: str) -> None:
        self.sched.finish(self.live.pop(rid))
        self._release(rid)

    def _release(self, rid: str) -> None:
        """What the core has the runner drop for a request that ended or was preempted."""
        self.held = {(r, j) for r, j in self.held if r != rid}
        self.slices = {h: v for h, v in self.slices.items() if v[0] != rid}

    def _fake_slices(self, batch) -> None:
        """The runner's sliced encodes: an image's shares add up, and once they cover it, its
        features go into the encoder cache (from which the scheduler lets its chunk pass it)."""
        for req, j, tokens in batch.encode_slices:
            span = req.images[j]
            owner, done = self.slices.get(span.content_hash, (req.request_id, 0))
            if done + tokens >= span.num_embeds:
                self.slices.pop(span.content_hash, None)
                self.encoder_cache.put(span.content_hash, torch.zeros(IMG_TOKENS))
            else:
                self.slices[span.content_hash] = (owner, done + tokens)

    def _check_image_features(self, batch) -> None:
        """The runner stores features only as the batches say: every image a chunk reaches must be
        new in this batch or held since an earlier one, and what is held is at most the one image
        each request's last chunk ended inside."""
        for req in batch.preempted:  # the core releases a preempted request's features
            self._release(req.request_id)
        new = {(req.request_id, j) for req, j in batch.new_images}
        assert not new & self.held, "features made again for an image the runner holds"
        for req, n in batch.items:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            for j, span in enumerate(req.images):
                if span.offset < end and start < span.offset + span.length:
                    assert (req.request_id, j) in new | self.held, "a chunk reaches an image with no features"
        self.held = (self.held | new) - set(batch.passed_images)
        held_per_request = [r for r, _ in self.held]
        assert len(held_per_request) == len(set(held_per_request)), "more than one image held for a request"

    def _fake_state(self, req: Request, n: int, snapshots: list[tuple[int, int]]) -> None:
        """What a hybrid forward does with the state: continue from the slot (zeros at the start),
        keep the state at each snapshot point, leave the chunk's end in the slot."""
        start, state = req.num_computed_tokens, self.states.recurrent[0]
        if start > 0:
            assert state[req.state_slot].item() == _state_value(req, start), (
                "a chunk continued from a wrong state"
            )
        for offset, row in snapshots:
            state[row] = _state_value(req, start + offset)
        state[req.state_slot] = _state_value(req, start + n)

    def _fake_run(self, req: Request, n: int) -> None:
        """What the runner does that the scheduler relies on: touched images end up encoded (in
        the encoder cache, which may evict them again) and the computed tokens advance."""
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        for span in req.images:
            touched = span.offset < end and start < span.offset + span.length
            if touched and self.encoder_cache.get(span.content_hash) is None:
                self.encoder_cache.put(span.content_hash, torch.zeros(IMG_TOKENS))
                self.slices.pop(span.content_hash, None)  # a sliced encode begun is finished
        self._fake_kv(req, start, end)
        req.num_computed_tokens = end

    def _fake_kv(self, req: Request, start: int, end: int) -> None:
        assert len(req.block_table) * BS >= end, "computing tokens that have no slot"
        for p in range(start, end):
            self.kv.k[0][req.block_table[p // BS], p % BS, 0] = torch.tensor(_slot_value(req, p))

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def blocks_add_up(self):
        if not hasattr(self, "blocks"):
            return
        holders: dict[int, int] = {}
        for req in self.live.values():
            flags = self.blocks.image_block_flags(req)
            for i, b in enumerate(req.block_table):
                holders[b] = holders.get(b, 0) + 1
                is_image = i < len(flags) and flags[i]
                assert (b in self.blocks.pools[IMAGE]) == is_image, "block in the wrong pool"
        for pool in self.blocks.pools.values():
            free, used, cached = pool.blocks_by_state()
            assert not (free & used) and not (free & cached) and not (used & cached), "a block in two places"
            assert len(free) + len(used) + len(cached) == pool.num_blocks
            assert free | used | cached == set(range(pool.first_block, pool.first_block + pool.num_blocks))
            for b in range(pool.first_block, pool.first_block + pool.num_blocks):
                assert pool.ref_count(b) == holders.get(b, 0), f"block {b}: refs != holders"
        for req in self.sched.waiting:
            assert req.status is Status.WAITING and not req.block_table and req.state_slot is None
        assert len(self.sched.running) <= self.sched.max_num_seqs
        if self.states is not None:
            slots = [r.state_slot for r in self.sched.running]
            assert None not in slots and len(set(slots)) == len(slots) == self.states.num_used

    @invariant()
    def kv_slots_hold_what_was_computed(self):
        if not hasattr(self, "blocks"):
            return
        for req in self.sched.running:
            for p in range(req.num_computed_tokens):
                got = self.kv.k[0][req.block_table[p // BS], p % BS, 0].tolist()
                assert got == _slot_value(req, p), f"request {req.request_id} position {p}: wrong KV"

    @invariant()
    def snapshots_name_cached_blocks(self):
        snapshots = getattr(getattr(self, "blocks", None), "snapshots", None)
        if snapshots is not None:
            assert all(self.blocks._alive(key) for key in snapshots._published), (
                "a snapshot outlived its block"
            )

    @invariant()
    def nothing_leaks_when_idle(self):
        if hasattr(self, "blocks") and not self.live:
            for pool in self.blocks.pools.values():
                assert pool.num_used == 0
            if self.states is not None:
                assert self.states.num_used == 0
            if self.sched.swap is not None:
                assert self.sched.swap.used_bytes == 0

    def teardown(self):
        if not hasattr(self, "blocks"):
            return
        # Drain: every request ends, and nobody waited past the aging bound without a reason.
        for _ in range(500):
            if not self.live and self.paused is None:
                break
            self.step(1.0)
        assert not self.live, "requests never finished"
        self.nothing_leaks_when_idle()


def _slot_value(req: Request, p: int) -> list[float]:
    """What the fake forward writes for position p: its token, and which image (if any) it is in
    (so two images' equal placeholder ids still differ)."""
    image = next((int(s.content_hash[3:]) + 1 for s in req.images if s.offset <= p < s.offset + s.length), 0)
    return [float(req.token_ids[p]), float(p + 1000 * image)]


def _state_value(req: Request, p: int) -> float:
    """A stand-in for the recurrent state after the first p tokens: a function of exactly those
    tokens (and images), exact in float32."""
    return float(
        sum((v[0] + 7 * v[1]) * (i + 1) for i, v in enumerate(_slot_value(req, i) for i in range(p))) % 65521
    )


TestScheduler = SchedulerMachine.TestCase
# derandomize: the same examples every run (a test is deterministic); the seeds tried once found
# the case below, kept as its own test.
TestScheduler.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)  # fmt: skip


def test_a_starved_image_request_goes_beside_decodes_in_a_time_bounded_step():
    """Steps bounded in time (factor 3): a waiting image request aged to the top was held back
    while one text request decoded, step after step, because its encoding did not fit the time
    left and the one-image-always-goes rule applied only where the token cap bound."""
    state = SchedulerMachine()

    def check() -> None:
        state.blocks_add_up()
        state.kv_slots_hold_what_was_computed()
        state.nothing_leaks_when_idle()
        state.snapshots_name_cached_blocks()

    state.setup(
        mode="recompute", n_text=8, n_image=4, max_seqs=2, budget=8, cap=None, snapshots=None, factor=3.0
    )
    check()
    state.arrive(image_seed=0, max_tokens=1, n_images=1, priority=0, words=[1])
    for _ in range(6):
        state.step(dt=0.5)
        check()
    state.arrive(image_seed=1, max_tokens=1, n_images=2, priority=0, words=[1])
    state.step(dt=0.5)
    state.arrive(image_seed=0, max_tokens=2, n_images=0, priority=0, words=[1])
    state.step(dt=0.5)
    check()
    state.arrive(image_seed=0, max_tokens=1, n_images=1, priority=0, words=[1])
    state.step(dt=3.0)
    check()
    state.step(dt=3.0)  # the image request, starved by now, goes beside the decode
    state.teardown()


def test_steps_beside_a_paused_background_step_leave_its_requests_alone():
    """A step of background work alone pauses; foreground work runs beside it without taking its
    requests' seats or blocks; a request that finds no seat has the paused step end first; an
    abort of a held request waits for the step."""
    state = SchedulerMachine()
    state.setup(
        mode="recompute", n_text=8, n_image=4, max_seqs=2, budget=8, cap=None, snapshots=None, factor=None,
        yielding=True,
    )  # fmt: skip
    state.arrive(image_seed=0, max_tokens=3, n_images=1, priority=2, words=[1, 2])
    state.step(dt=0.5)
    assert state.paused is not None and state._held() == {"0"}
    state.arrive(image_seed=0, max_tokens=2, n_images=0, priority=0, words=[3])
    state.step(dt=0.5)  # the foreground request's prefill, beside the paused step
    fg = state.live["1"]
    assert state.paused is not None and fg.num_computed_tokens == fg.num_prompt_tokens
    state.kv_slots_hold_what_was_computed()
    state.arrive(image_seed=1, max_tokens=1, n_images=0, priority=0, words=[4])  # no seat left
    state.step(dt=0.5)
    assert state.paused_in_way and state.paused is not None
    state.abort(data=_Draw("0"))  # held: it ends with its step
    assert "0" in state.live and state.aborted == {"0"}
    state.step(dt=0.5)  # the paused step ends first, and its aborted request with it
    assert state.paused is None and "0" not in state.live
    state.blocks_add_up()
    state.kv_slots_hold_what_was_computed()
    state.teardown()


class _Draw:
    """Stands in for hypothesis' `data` in a rule called by hand: draws the value given."""

    def __init__(self, value) -> None:
        self.value = value

    def draw(self, strategy):
        return self.value
