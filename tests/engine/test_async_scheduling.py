"""Async scheduling (core/launcher.py): step N+1 is scheduled and prepared while step N computes.

Every test runs the same requests with it off and on (both launch modes: `inline`, where a CPU
forward runs at once, and `thread`, where it really runs beside the host) and wants the same
tokens, the same finish reasons, the same batches where no request ends on EOS, and every block
free at the end: through preemption (recompute and swap), images, aborts, stop strings and a
failing step.
"""

from __future__ import annotations

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.core.faults import StepFailedError

MODES = ["inline", "thread"]
TIGHT = dict(kv_cache_memory_bytes=16 * 1024 * 20, block_size=8, image_pool_fraction=0.4)


def _llm(path: str, mode: str | None, **kwargs) -> LLM:
    if mode is not None:
        kwargs.update(async_scheduling=True, async_launch=mode)
    return LLM(path, **kwargs)


def _prompt(i: int) -> str | dict:
    words = "what is this " * (i % 3) + f"number {i}"
    if i % 2:
        return f"USER: {words} ASSISTANT:"
    return {"prompt": f"USER: <image> {words} ASSISTANT:", "multi_modal_data": {"image": [make_image(i % 4)]}}


def _params(i: int, **kwargs) -> SamplingParams:
    if i % 3 == 2:  # seeded random: its own generator, so the same tokens whatever the batch
        return SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=6 + 2 * i, **kwargs)
    return SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, **kwargs)


def _record_batches(llm: LLM) -> list:
    """Each step's scheduled (request, tokens) pairs and preempted requests, as the scheduler made them."""
    sched, seen = llm.engine.core.scheduler, []
    schedule = sched.schedule

    def watched(now, held=frozenset()):
        batch = schedule(now, held)
        seen.append(([(r.request_id, n) for r, n in batch.items], [r.request_id for r in batch.preempted]))
        return batch

    sched.schedule = watched
    return seen


def _assert_all_free(llm: LLM) -> None:
    assert all(pool.num_used == 0 for pool in llm.engine.core.blocks.pools.values())
    assert not llm.engine.core.requests and not llm.engine.core.runner.features.held


def _run(llm: LLM, n: int, **kwargs) -> list[tuple[list[int], str]]:
    outs = llm.generate([_prompt(i) for i in range(n)], [_params(i, **kwargs) for i in range(n)])
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_same_tokens_through_eos_images_and_seeded_sampling(clip_llama, mode):
    expected = _run(_llm(clip_llama, None, max_num_seqs=4), 10)
    llm = _llm(clip_llama, mode, max_num_seqs=4)
    assert _run(llm, 10) == expected
    assert any(reason == "stop" for _, reason in expected)  # some ended on EOS, found out late
    _assert_all_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("mode", MODES)
def test_same_batches_and_tokens_through_preemption(clip_llama, mode, preemption_mode):
    """No request ends on EOS here, so the scheduler must make exactly the batches (and the
    preemptions) of the plain loop: each in-flight token counts as if it were there, and a
    request whose last token is in flight leaves on time. First come, first served: the priority
    policy's aging ranks each request by how long it waited in wall-clock time, so two runs could
    rank (and preempt) differently when the machine is busy."""
    kw = dict(TIGHT, preemption_mode=preemption_mode, scheduling_policy="fcfs")
    plain = _llm(clip_llama, None, **kw)
    plain_batches = _record_batches(plain)
    expected = _run(plain, 8, ignore_eos=True)
    assert plain.engine.core.scheduler.num_preemptions > 0
    llm = _llm(clip_llama, mode, **kw)
    batches = _record_batches(llm)
    assert _run(llm, 8, ignore_eos=True) == expected
    assert batches[:-1] == plain_batches and batches[-1] == ([], [])  # the last step only reads tokens
    _assert_all_free(llm)


def _steps(llm: LLM, n: int, abort_at: dict[int, str]) -> dict[str, tuple[list[int], str | None]]:
    """Drive the engine by hand for `n` requests, aborting `abort_at[step]` before that step;
    returns each request's tokens as handed out and how it ended (None: aborted)."""
    engine = llm.engine
    for i in range(n):
        engine.add_request(_prompt(i), _params(i, stop=["left bottom", "describe"]), request_id=f"r{i}")
    got: dict[str, tuple[list[int], str | None]] = {f"r{i}": ([], None) for i in range(n)}
    step = 0
    while engine.has_unfinished():
        if step in abort_at:
            engine.abort(abort_at[step])
        for out in engine.step():
            got[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        step += 1
    return got


@pytest.mark.parametrize("mode", MODES)
def test_aborts_and_stop_strings_while_a_step_is_in_flight(clip_llama, mode):
    aborts = {2: "r3", 6: "r5", 8: "r6"}  # r3 and r5 before their first token, r6 while it decodes
    expected = _steps(_llm(clip_llama, None, max_num_seqs=3), 7, aborts)
    assert [expected[f"r{i}"][1] for i in range(7)] == ["stop", "stop", "stop", None, "stop", None, None]
    llm = _llm(clip_llama, mode, max_num_seqs=3)
    got = _steps(llm, 7, aborts)
    for rid in ("r0", "r1", "r2", "r4"):  # not aborted: finished the same (by stop strings or EOS)
        assert got[rid] == expected[rid], rid
    for rid in aborts.values():  # aborted: what it had was handed out no later than without async
        assert got[rid][1] is None and got[rid][0] == expected[rid][0][: len(got[rid][0])], rid
    assert len(got["r6"][0]) > 0  # it was decoding when the abort came
    _assert_all_free(llm)


def _poison(llm: LLM, rid: str) -> None:
    """The forward of any step holding `rid` raises."""
    forward = llm.engine.core.runner.forward

    def faulty(inputs, prev_tokens=None):
        if rid in poisoned:
            raise RuntimeError("shape mismatch")
        return forward(inputs, prev_tokens)

    prepare = llm.engine.core.runner.prepare
    poisoned: set[str] = set()

    def watched(batch, *rest):
        poisoned.clear()
        poisoned.update(r.request_id for r, _ in batch.items if r.request_id == rid)
        return prepare(batch, *rest)

    llm.engine.core.runner.prepare, llm.engine.core.runner.forward = watched, faulty


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_step_fails_its_requests_and_the_rest_are_served(clip_llama, mode):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = _llm(clip_llama, None).generate("USER: good ASSISTANT:", params)[0].outputs[0].token_ids
    llm = _llm(clip_llama, mode, max_num_seqs=1)
    engine = llm.engine
    _poison(llm, "bad")
    engine.add_request("USER: bad ASSISTANT:", params, request_id="bad")
    engine.add_request("USER: good ASSISTANT:", params, request_id="good")  # waits: one seat
    with pytest.raises(StepFailedError) as info:
        while True:  # the failure is found out where the step's tokens are read
            engine.step()
    assert info.value.request_ids == ["bad"] and not info.value.device_lost
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["good"]
    assert finals[0].outputs[0].token_ids == expected
    _assert_all_free(llm)


def test_mrope_family_same_tokens(vl_family):
    """Qwen2.5-VL: M-RoPE positions of decodes whose input is still in flight."""
    from helpers.families import family_prompt, greedy, mm

    path, ref = vl_family("qwen2_5_vl")
    cases = [(family_prompt("qwen2_5_vl", "describe", 1), [make_image(3, (40, 60))], 8),
             (family_prompt("qwen2_5_vl", "hello there", 0), [], 6)]  # fmt: skip
    llm = _llm(path, "thread", kv_cache_memory_bytes=8 * 1024**2, block_size=8, max_num_batched_tokens=16)
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
    for out, (text, imgs, n) in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n)
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_step_leaves_no_block_in_the_prefix_cache(clip_llama, mode):
    """The prefill that failed wrote no KV: the blocks it would have offered for reuse must not be
    found by the next request with the same prompt."""
    prompt = "USER: " + "what is this number " * 8 + "ASSISTANT:"
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    kw = dict(block_size=4, kv_cache_memory_bytes=4 * 1024**2)
    want = _llm(clip_llama, None, **kw).generate(prompt, params)[0].outputs[0].token_ids
    llm = _llm(clip_llama, mode, **kw)
    _poison(llm, "bad")
    llm.engine.add_request(prompt, params, request_id="bad")
    with pytest.raises(StepFailedError):
        while llm.engine.has_unfinished():
            llm.engine.step()
    again = llm.generate(prompt, params)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", MODES)
def test_n_samples_copy_the_partial_prompt_block_behind_the_forward(clip_llama, mode):
    """The children copy the first sample's partial prompt block while its next step may still
    be computing: the copy runs in the forward's order, so the samples equal the plain loop's."""
    params = SamplingParams(n=4, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    prompts = [_prompt(3), _prompt(4)]
    expected = _llm(clip_llama, None, block_size=8).generate(prompts, params)
    llm = _llm(clip_llama, mode, block_size=8)
    got = llm.generate(prompts, params)
    samples = [[c.token_ids for c in o.outputs] for o in got]
    assert samples == [[c.token_ids for c in o.outputs] for o in expected]
    # Prompt 1 has full blocks: its children wait for them and then copy its partial one. Prompt
    # 0 fits in one partial block: its children start with it, and compute their own.
    assert [(len(o.prompt_token_ids) - 1) // 8 > 0 for o in got] == [False, True]
    assert llm.kv_report()["text"]["partial_block_copies"] == 3
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_of_background_work_alone_is_read_before_the_next_is_scheduled(clip_llama, mode):
    """While only Batch API work runs, a call that finds a background step in flight reads it and
    schedules nothing, so a request that arrives while it computes goes into the very next step
    instead of waiting behind one more background step. Tokens are those of the plain loop."""
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [_prompt(0), _prompt(2)]
    fg_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    plain = _llm(clip_llama, None, max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, long)]
    fg_want = plain.generate(_prompt(5), fg_params)[0].outputs[0].token_ids
    llm = _llm(clip_llama, mode, max_num_seqs=4)
    engine, core = llm.engine, llm.engine.core
    batches = _record_batches(llm)
    ids = [engine.add_request(p, long, priority=10) for p in prompts]
    outs = {}
    for _ in range(6):
        inflight = core._inflight
        launched_before = len(batches)
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        if inflight is not None and inflight.background_only:
            assert len(batches) == launched_before and core._inflight is None  # read, none launched
    assert core._inflight is None or core._inflight.background_only
    if core._inflight is not None:
        outs.update({o.request_id: o for o in engine.step() if o.finished})  # read: the next schedules
    fg = engine.add_request(_prompt(5), fg_params)
    outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert fg in [rid for rid, _ in batches[-1][0]]  # in the very next batch
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs[i].outputs[0].token_ids for i in ids] == want
    assert outs[fg].outputs[0].token_ids == fg_want
    _assert_all_free(llm)
