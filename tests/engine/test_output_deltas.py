"""Outputs cross from the engine thread as deltas, one hand-over per step, and what a slow
consumer has not read yet is merged into its next output (memory linear in the output)."""

from __future__ import annotations

import asyncio

import pytest

from mm_engine import LLM, RequestOutputKind, SamplingParams
from mm_engine.async_llm import AsyncLLM

PROMPT = "USER: what ASSISTANT:"
KW = dict(kv_cache_memory_bytes=4 * 1024**2)


def _params(kind: RequestOutputKind, n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=kind)


@pytest.fixture(scope="module")
def reference(clip_llama):
    out = LLM(clip_llama, **KW).generate(PROMPT, _params(RequestOutputKind.CUMULATIVE))[0]
    return out.outputs[0].token_ids, out.outputs[0].text


def _engine_outputs(clip_llama, kind: RequestOutputKind) -> list:
    engine = LLM(clip_llama, **KW).engine
    engine.add_request(PROMPT, _params(kind), request_id="r")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_the_engine_shapes_outputs_by_kind(clip_llama, reference):
    ids, text = reference
    delta = _engine_outputs(clip_llama, RequestOutputKind.DELTA)
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 8
    assert [t for o in delta for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in delta) == text
    final = _engine_outputs(clip_llama, RequestOutputKind.FINAL_ONLY)
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == ids
    cumulative = _engine_outputs(clip_llama, RequestOutputKind.CUMULATIVE)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 9))


def test_one_hand_over_per_step_and_a_slow_consumer_gets_the_rest_merged(clip_llama, reference):
    ids, text = reference
    llm = AsyncLLM.from_engine_args(clip_llama, **KW)
    steps = []
    step = llm.engine.step

    def counted_step():
        outs = step()
        steps.append(len(outs))
        return outs

    llm.engine.step = counted_step

    async def consume(kind: RequestOutputKind, rid: str) -> list:
        inputs = await llm.process_prompt(PROMPT)
        gen = llm.generate(inputs, _params(kind), request_id=rid)
        outs = [await anext(gen)]
        while await llm.call(lambda e: rid in e.core.requests):  # the consumer sleeps; the engine runs
            await asyncio.sleep(0.01)
        outs += [out async for out in gen]
        return outs

    async def scenario():
        loop = asyncio.get_running_loop()
        hand_overs = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            hand_overs.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        try:
            results = await asyncio.gather(
                *(consume(kind, kind.name) for kind in RequestOutputKind),
            )
            return results, hand_overs
        finally:
            await llm.shutdown()

    (cumulative, delta, final), hand_overs = asyncio.run(scenario())  # in RequestOutputKind order
    # The first output, then the rest merged into one. (On a loaded machine the engine may finish
    # a request before its consumer first wakes: then the first output is already all of it.)
    assert 1 <= len(delta) <= 2 and 1 <= len(cumulative) <= 2 and len(final) == 1
    assert [t for o in delta for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in delta) == text
    assert delta[-1].delta_text == delta[-1].outputs[0].text and delta[-1].finished
    assert cumulative[-1].outputs[0].token_ids == ids and cumulative[-1].outputs[0].text == text
    before = cumulative[0].outputs[0].text if len(cumulative) == 2 else ""
    assert cumulative[-1].delta_text == text[len(before) :]
    assert final[0].outputs[0].token_ids == ids and final[0].outputs[0].text == text
    # Three streams decoded together: one hand-over per step that had outputs, not one per output.
    with_outputs = sum(1 for n in steps if n)
    assert sum(steps) >= 3 * 8
    assert sum(1 for cb in hand_overs if getattr(cb, "__name__", "") == "_deliver") == with_outputs
