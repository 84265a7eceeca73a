"""A step of background work alone pauses before its next layer when something arrives
(`background_yield`, core/background_yield.py): foreground requests run their steps meanwhile, the
paused step resumes once they leave a step free, and every request's tokens are those of a run
without pausing. Here `arrivals` always says yes, so a background step pauses at every layer of its
tower and language model: the most interleaving there can be."""

from __future__ import annotations

import threading

import pytest

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm
from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.core.faults import StepFailedError
from mm_engine.core.yielding_step import YieldingStep
from mm_engine.models.layers.layer_gate import layer_boundary

KV = 8 * 1024**2


def _layers(n: int, log: list, fail_at: int | None = None):
    def work():
        for i in range(n):
            layer_boundary()
            if i == fail_at:
                raise ValueError("layer failed")
            log.append(i)
        return "done"

    return work


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "mm-engine-yielding-step"}


def test_a_yielding_step_pauses_before_the_next_layer_while_something_arrived():
    log: list = []
    step = YieldingStep(_layers(3, log), 1)
    assert log == []  # nothing runs before the first run()
    assert step.run(lambda: True) is False and log == []  # paused before its first layer
    assert step.run(lambda: True) is False and log == [0]
    assert step.run(lambda: False) is True and log == [0, 1, 2]
    assert step.result() == "done" and step.pauses == 2


def test_an_error_is_raised_by_result_and_cancel_ends_a_paused_step():
    failing = YieldingStep(_layers(3, [], fail_at=1), 1)
    assert failing.run(lambda: False) is True
    with pytest.raises(ValueError, match="layer failed"):
        failing.result()
    before = _threads()
    paused = YieldingStep(_layers(3, []), 1)
    assert paused.run(lambda: True) is False
    paused.cancel()
    assert _threads() == before - {paused._thread}


def _interleaved(llm: LLM, background: list, foreground: list) -> dict[str, list[int]]:
    """Background requests first, paused at every layer; the foreground ones added once the first
    step paused. Returns each request's tokens; checks the foreground's first token came while
    the background step was paused."""
    core, eng = llm.engine.core, llm.engine
    core.arrivals = lambda: True
    bg = [eng.add_request(p, sp, priority=10) for p, sp in background]
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids

    step()
    assert core._paused is not None and core._paused.held <= set(bg)
    fg = [eng.add_request(p, sp) for p, sp in foreground]
    while not all(r in outs for r in fg):
        step()
        if any(r in outs for r in fg):
            assert core._paused is not None, "the foreground request waited for the background step"
    while eng.has_unfinished():
        step()
    return outs


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5", "gemma3", "llava_next"])
def test_tokens_equal_transformers_when_background_steps_pause_at_every_layer(vl_family, family):
    """Pauses inside the tower (Qwen2.5's windows, LLaVA-NeXT's tiles, Gemma 3's whole images) and
    inside the language model (Qwen3.5's linear-attention states, updated layer by layer)."""
    path, ref = vl_family(family)
    cases = [(family_prompt(family, "describe", 1), [make_image(3, (40, 60))], 6),
             (family_prompt(family, "what is it", 1), [make_image(4, (48, 32))], 5),
             (family_prompt(family, "and this", 1), [make_image(5, (32, 40))], 4)]  # fmt: skip
    llm = engine(path)
    reqs = [(mm(text, imgs), greedy(n)) for text, imgs, n in cases]
    outs = _interleaved(llm, reqs[:2], reqs[2:])
    assert [outs[str(i)] for i in range(3)] == [ref.generate(t, imgs, n) for t, imgs, n in cases]
    assert llm.engine.core._paused is None
    assert_all_free(llm)


def _prompt(seed: int) -> dict:
    return {
        "prompt": "USER: <image> what is this ASSISTANT:",
        "multi_modal_data": {"image": make_image(seed)},
    }


def test_an_abort_of_a_held_request_waits_for_its_step(clip_llama):
    long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    core, eng = llm.engine.core, llm.engine
    core.arrivals = lambda: True
    gone, kept = (eng.add_request(_prompt(s), long, priority=10) for s in (5, 6))
    eng.step()
    assert core._paused is not None and gone in core._paused.held
    eng.abort(gone)
    held = next(r for r in core.scheduler.running if r.request_id == gone)
    assert held.block_table, "its blocks were freed while the paused step still writes them"
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert gone not in outs
    alone = LLM(clip_llama, kv_cache_memory_bytes=KV).generate(_prompt(6), long)[0].outputs[0].token_ids
    assert outs[kept].outputs[0].token_ids == alone
    assert_all_free(llm)


def test_a_paused_step_that_fails_fails_its_own_requests_only(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    core, eng = llm.engine.core, llm.engine
    core.arrivals = lambda: True
    execute = core.runner.execute

    def failing(batch):
        if batch.background_only:
            layer_boundary()  # it pauses here first
            raise RuntimeError("tower broke")
        return execute(batch)

    core.runner.execute = failing
    bg = eng.add_request(_prompt(5), greedy(4), priority=10)
    eng.step()
    assert core._paused is not None
    fg = eng.add_request(_prompt(6), greedy(4))
    outs = {}
    with pytest.raises(StepFailedError) as failed:
        while True:
            outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert failed.value.request_ids == [bg] and fg in outs  # the foreground one ran meanwhile
    assert not eng.has_unfinished()
    assert_all_free(llm)


def test_the_caller_says_how_the_core_sees_arrivals(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    assert llm.engine.core.arrivals is None  # offline: nothing arrives during a step
    seen = [False]
    llm.engine.watch_arrivals(lambda: seen[0])
    assert llm.engine.core.arrivals() is False
    seen[0] = True
    assert llm.engine.core.arrivals() is True
    assert llm.engine.core.background_yield  # plain loop, one rank
    off = LLM(clip_llama, kv_cache_memory_bytes=KV, background_yield=False)
    assert not off.engine.core.background_yield
