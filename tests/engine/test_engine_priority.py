"""Priority that bites: image-first, explicit priority, preemption of running requests, and
outputs that the machinery never changes."""

from __future__ import annotations

import pytest

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.sched.scheduler import QueueFullError

KV = 8 * 1024**2


def image_prompt(seed: int, words: str = "what is this") -> dict:
    return {"prompt": f"USER: <image> {words} ASSISTANT:", "multi_modal_data": {"image": make_image(seed)}}


def text_prompt(words: str) -> str:
    return f"USER: {words} ASSISTANT:"


def first_token_steps(
    llm: LLM, prompts: list, params: list, priorities: list[int] | None = None
) -> list[int]:
    """Submit everything at once, step by hand, and return the step of each request's first token."""
    engine = llm.engine
    ids = [
        engine.add_request(p, sp, priority=(priorities or [0] * len(prompts))[i])
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, step)
        step += 1
    return [first[i] for i in ids]


def mixed(n: int):
    prompts, kinds = [], []
    for i in range(n):
        if i % 2 == 0:
            prompts.append(text_prompt("how many shapes " * (1 + i % 3)))
            kinds.append("text")
        else:
            prompts.append(image_prompt(i))
            kinds.append("image")
    return prompts, kinds


def test_image_requests_first_under_priority_and_arrival_order_under_fcfs(clip_llama):
    prompts, kinds = mixed(8)  # text first in arrival order
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True) for _ in prompts]
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=2, scheduling_policy="priority")
    steps = first_token_steps(llm, prompts, params)
    image_steps = [s for s, k in zip(steps, kinds, strict=True) if k == "image"]
    text_steps = [s for s, k in zip(steps, kinds, strict=True) if k == "text"]
    assert max(image_steps) < min(text_steps)

    fcfs = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=2, scheduling_policy="fcfs")
    steps = first_token_steps(fcfs, prompts, params)
    assert steps == sorted(steps) and steps[0] < steps[-1]


def test_explicit_priority_beats_image_first(clip_llama):
    prompts, kinds = mixed(6)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True) for _ in prompts]
    priorities = [-1 if k == "text" else 0 for k in kinds]
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=1)
    steps = first_token_steps(llm, prompts, params, priorities)
    text_steps = [s for s, k in zip(steps, kinds, strict=True) if k == "text"]
    image_steps = [s for s, k in zip(steps, kinds, strict=True) if k == "image"]
    assert max(text_steps) < min(image_steps)


def test_waiting_high_priority_preempts_running_low_priority_in_a_full_batch(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=2)
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    low = [engine.add_request(image_prompt(s), long, priority=5) for s in (1, 2)]
    for _ in range(3):
        engine.step()
    assert {r.request_id for r in engine.core.scheduler.running} == set(low)
    urgent = engine.add_request(
        text_prompt("tell me"), SamplingParams(temperature=0, max_tokens=3), priority=0
    )
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        if urgent in outs:
            assert not any(rid in outs for rid in low)  # it finished while the batch was full of others
            break
    assert engine.core.scheduler.num_preemptions >= 1
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    alone = LLM(clip_llama, kv_cache_memory_bytes=KV)
    for rid, seed in zip(low, (1, 2), strict=True):
        assert (
            outs[rid].outputs[0].token_ids == alone.generate(image_prompt(seed), long)[0].outputs[0].token_ids
        )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_do_not_change_outputs(clip_llama, mode):
    prompts = [image_prompt(20 + i, "what is this " * (i % 3)) for i in range(6)] + [text_prompt("how many")]
    params = [SamplingParams(temperature=0, max_tokens=18 + 3 * i, ignore_eos=True) for i in range(7)]
    plain = LLM(clip_llama, kv_cache_memory_bytes=KV, enable_prefix_caching=False)
    expected = [plain.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    # 16 KiB per block of 8: 20 blocks cannot hold the batch at once.
    tight = LLM(
        clip_llama,
        kv_cache_memory_bytes=16 * 1024 * 20,
        block_size=8,
        image_pool_fraction=0.4,
        preemption_mode=mode,
        swap_space_bytes=16 * 1024 * 6,  # room for some victims only: the rest recompute
    )
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.core.scheduler.num_preemptions > 0
    report = tight.kv_report()
    if mode == "swap":
        assert report["swap"]["swapped_out_blocks"] > 0
        assert report["swap"]["swapped_in_blocks"] > 0
        assert report["swap"]["host_bytes_used"] == 0
    assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0


def test_queue_full_is_refused_clearly_online_and_waited_out_offline(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_waiting_requests=2)
    engine = llm.engine
    engine.add_request(text_prompt("a"), SamplingParams(max_tokens=2))
    engine.add_request(text_prompt("b"), SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="queue full"):
        engine.add_request(text_prompt("c"), SamplingParams(max_tokens=2))
    assert len(engine.core.requests) == 2  # the refused one left nothing behind
    while engine.has_unfinished():
        engine.step()
    # LLM.generate is offline: more prompts than the queue holds just wait their turn.
    outs = llm.generate([text_prompt(w) for w in "abcdefg"], SamplingParams(temperature=0, max_tokens=2))
    assert len(outs) == 7 and all(o.finished for o in outs)
    assert not engine.core.requests and llm.kv_report()["text"]["used_blocks"] == 0


def test_background_requests_never_age_ahead_and_are_preempted_first(clip_llama):
    """Batch API work (priority at or above `background_priority`) fills idle seats, goes after a
    foreground request however long it has waited, and gives its seat to one that arrives."""
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=1, max_wait_s=0.001, background_priority=10)
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    batch = [engine.add_request(image_prompt(s), long, priority=10) for s in (3, 4)]
    engine.step()
    assert [r.request_id for r in engine.core.scheduler.running] == batch[:1]
    # A text request of priority 9 would not outrank a running image one of priority 10 by the
    # margin; a foreground one does, because background is a tier below.
    fg = engine.add_request(text_prompt("tell me"), SamplingParams(temperature=0, max_tokens=3), priority=9)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    # The waiting background request had waited far past max_wait_s, and still went after it.
    assert list(outs)[0] == fg
    assert engine.core.scheduler.num_preemptions >= 1
    alone = LLM(clip_llama, kv_cache_memory_bytes=KV)
    for rid, seed in zip(batch, (3, 4), strict=True):
        want = alone.generate(image_prompt(seed), long)[0].outputs[0].token_ids
        assert outs[rid].outputs[0].token_ids == want
    report = llm.kv_report()
    assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0


def test_background_work_waits_for_steps_without_foreground_work(clip_llama):
    """With `background_step_tokens=0` (the default), a step that runs a foreground request gives
    background requests nothing, so their decodes never lengthen it; steps without foreground work
    give them the whole budget. Outputs are those of each request alone."""
    llm = LLM(clip_llama, kv_cache_memory_bytes=KV, max_num_seqs=4)
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = [engine.add_request(image_prompt(s), long, priority=10) for s in (5, 6)]
    for _ in range(3):
        engine.step()  # alone: they run
    assert all(r.num_computed_tokens > 0 for r in engine.core.scheduler.running)
    fg = engine.add_request(
        text_prompt("how many"), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    outs, fg_steps = {}, 0
    while fg not in outs:
        before = {r.request_id: r.num_computed_tokens for r in engine.core.scheduler.running}
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        after = {r.request_id: r.num_computed_tokens for r in engine.core.scheduler.running}
        assert all(after.get(r, before.get(r)) == before.get(r) for r in batch)  # no background token
        fg_steps += 1
    assert fg_steps >= 6
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    alone = LLM(clip_llama, kv_cache_memory_bytes=KV)
    for rid, seed in zip(batch, (5, 6), strict=True):
        assert (
            outs[rid].outputs[0].token_ids == alone.generate(image_prompt(seed), long)[0].outputs[0].token_ids
        )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3", "llava_next", "gemma3"])
def test_background_image_requests_equal_transformers_in_every_image_layout(vl_family, family):
    """A step of background work alone encodes an image with the prompt up to its first token
    and prefills its run later (M-RoPE grids, tiled images with row/column tokens, LLaVA-NeXT's
    newline tokens; Gemma 3's whole images go in one step): tokens are transformers'."""
    from helpers.families import family_prompt, greedy, mm

    path, ref = vl_family(family)
    cases = [(family_prompt(family, "describe", 1), [make_image(3, (40, 60))], 6),
             (family_prompt(family, "what is it", 1), [make_image(4, (48, 32))], 5)]  # fmt: skip
    llm = LLM(path, kv_cache_memory_bytes=8 * 1024**2, block_size=8, background_priority=10)
    sched, encoding_steps = llm.engine.core.scheduler, []
    schedule = sched.schedule

    def watched(now, held=frozenset()):
        batch = schedule(now, held)
        if batch.encoder_tokens:
            encoding_steps.append([(r.num_computed_tokens, n, r.images[0].offset) for r, n in batch.items])
        return batch

    sched.schedule = watched
    prompts, params = [mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases]
    outs = llm.generate(prompts, params, priority=[10, 10])
    assert len(encoding_steps) == 2  # one image a step
    for step in encoding_steps:  # the image's first token ends the chunk, but for whole images
        (start, n, offset), *_ = [(a, n, o) for a, n, o in step if a <= o < a + n]  # the one that encodes
        assert (start + n == offset + 1) != (family == "gemma3")
    for out, (text, imgs, n) in zip(outs, cases, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n)
    report = llm.kv_report()
    assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0
