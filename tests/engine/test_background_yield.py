"""A step of background work alone gives way before its next layer when something arrives
(`background_yield`, core/background_yield.py): foreground requests run their steps beside it,
inside its layer gate, on the same thread; it goes on once they leave nothing to run, and every
request's tokens are those of a run without pausing. Here `arrivals` always says yes, so a
background step gives way at every layer of its tower and language model: the most interleaving
there can be."""

from __future__ import annotations

import pytest

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm
from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.core.faults import StepFailedError
from mm_engine.models.layers.layer_gate import layer_boundary

KV = 8 * 1024**2


def _drive(llm: LLM, foreground: list, outs: dict, beside: list, then=None) -> None:
    """Be the driver a core process is: at each layer of a background step, add the foreground
    requests (the first time; then `then(core)`) and run steps beside it until none is left, their
    outputs through the frontend as `LLMEngine.step` hands them on."""
    core, eng = llm.engine.core, llm.engine
    added: list[str] = []

    def yield_to() -> None:
        if not added:
            added.extend(eng.add_request(p, sp) for p, sp in foreground)
            added.append("")  # (none to add is also done)
            if then is not None:
                then(core)
        while (core_outs := core.step_beside()) is not None:
            beside.extend(o.request_id for o in core_outs)
            _collect(eng.frontend.process_outputs(core_outs)[0], outs)

    core.arrivals = lambda: True
    core.yield_to = yield_to


def _collect(outputs: list, outs: dict) -> None:
    for out in outputs:
        if out.finished:
            outs[out.request_id] = out.outputs[0].token_ids


def _interleaved(llm: LLM, background: list, foreground: list) -> dict[str, list[int]]:
    """Background requests, giving way at every layer of their steps to the foreground ones
    (added at the first). Returns each request's tokens; checks that every foreground request got
    its tokens beside a paused background step."""
    outs: dict[str, list[int]] = {}
    beside: list[str] = []
    _drive(llm, foreground, outs, beside)
    eng = llm.engine
    for p, sp in background:
        eng.add_request(p, sp, priority=10)
    while eng.has_unfinished():
        _collect(eng.step(), outs)
    fg = {str(len(background) + i) for i in range(len(foreground))}
    assert fg <= set(beside) and fg <= set(outs)
    return outs


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5", "gemma3", "llava_next"])
def test_tokens_equal_transformers_when_background_steps_give_way_at_every_layer(vl_family, family):
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
    image = make_image(seed)
    return {"prompt": "USER: <image> what is this ASSISTANT:", "multi_modal_data": {"image": image}}


def test_an_abort_of_a_held_request_waits_for_its_step(clip_llama):
    long = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    eng, outs, seen = llm.engine, {}, []
    gone, kept = (eng.add_request(_prompt(s), long, priority=10) for s in (5, 6))

    def abort(core) -> None:
        assert gone in core._paused.held
        eng.abort(gone)
        held = next(r for r in core.scheduler.running if r.request_id == gone)
        assert held.block_table, "its blocks were freed while the paused step still writes them"
        seen.append(gone)

    _drive(llm, [], outs, [], then=abort)
    while eng.has_unfinished():
        _collect(eng.step(), outs)
    assert seen == [gone] and gone not in outs
    alone = LLM(clip_llama, kv_cache_memory_bytes=KV).generate(_prompt(6), long)[0].outputs[0].token_ids
    assert outs[kept] == alone
    assert_all_free(llm)


def test_a_paused_step_that_fails_fails_its_own_requests_only(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    core, eng, outs = llm.engine.core, llm.engine, {}
    execute = core.runner.execute

    def failing(batch):
        if batch.background_only:
            layer_boundary()  # it gives way here first
            raise RuntimeError("tower broke")
        return execute(batch)

    core.runner.execute = failing
    bg = eng.add_request(_prompt(5), greedy(4), priority=10)
    _drive(llm, [(_prompt(6), greedy(4))], outs, [])
    with pytest.raises(StepFailedError) as failed:
        eng.step()
    assert failed.value.request_ids == [bg] and "1" in outs  # the foreground one ran meanwhile
    assert not eng.has_unfinished()
    assert_all_free(llm)


def test_no_pausing_without_a_driver_or_when_turned_off(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV)
    core = llm.engine.core
    assert core.arrivals is None and core.yield_to is None  # offline: nothing arrives during a step
    assert core.background_yield  # the plain loop, one rank
    assert not LLM(clip_llama, kv_cache_memory_bytes=KV, background_yield=False).engine.core.background_yield
