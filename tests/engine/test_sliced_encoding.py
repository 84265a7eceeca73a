"""An image bigger than what a capped step may encode is encoded a share of its tower a step
(`sliced_encoding`, vision/sliced_encode.py): for every family the features equal a whole encode's
and each share runs the layers asked; in the engine, running streams get their token in every step
meanwhile, the image's request waits before the image until it is done, tokens equal those with
slicing off, and an abort unwinds the paused encode. The encode runs on the caller's thread."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from greenlet import getcurrent, greenlet

from helpers.families import ALL_FAMILIES, assert_all_free, engine, family_prompt, mm
from helpers.images import make_image
from mm_engine import SamplingParams
from mm_engine.core.faults import StepFailedError
from mm_engine.models.layers.layer_gate import layer_boundary
from mm_engine.request import ImageSpan
from mm_engine.vision.sliced_encode import SlicedEncode, SlicedEncodes


def _paused() -> list[greenlet]:
    """Encodes begun and not ended (a greenlet is true while it has started and not ended)."""
    return [g for g in gc.get_objects() if type(g) is greenlet and g and g is not getcurrent()]


def _fake_encode(depth: int, log: list, fail_at: int | None = None):
    def encode(spans):
        x = torch.zeros(2)
        log.append("before")
        for i in range(depth):
            layer_boundary()
            if i == fail_at:
                raise ValueError("layer failed")
            log.append(i)
            x += 1
        log.append("after")
        return [x]

    return encode


def test_each_advance_runs_the_layers_asked_then_pauses():
    log: list = []
    enc = SlicedEncode(_fake_encode(5, log), None, "r")
    assert log == []  # nothing runs before the first advance
    assert enc.advance(2) is None and log == ["before", 0, 1]
    assert enc.advance(1) is None and log[-1] == 2
    out = enc.advance(9)  # more than is left: it finishes
    assert log[-3:] == [3, 4, "after"] and out.tolist() == [5.0, 5.0] and enc.layers_done == 5


def test_the_encode_runs_on_the_callers_thread():
    # A thread of its own would own a second OpenMP team, which slows every step of the engine's.
    seen: list[int] = []

    def encode(spans):
        for _ in range(3):
            layer_boundary()
            seen.append(threading.get_ident())
        return [torch.zeros(1)]

    enc = SlicedEncode(encode, None, "r")
    while enc.advance(1) is None:
        pass
    assert seen == [threading.get_ident()] * 3


def test_an_error_in_the_encode_is_raised_by_advance_and_cancel_unwinds_it():
    enc = SlicedEncode(_fake_encode(4, [], fail_at=1), None, "r")
    assert enc.advance(1) is None
    with pytest.raises(ValueError, match="layer failed"):
        enc.advance(1)
    with pytest.raises(RuntimeError, match="has ended"):  # not a switch into an encode that ended
        enc.advance(1)
    unwound: list[str] = []

    def encode(spans):
        try:
            for _ in range(4):
                layer_boundary()
        finally:
            unwound.append("finally")
        return [torch.zeros(1)]

    paused = SlicedEncode(encode, None, "r")
    paused.advance(1)
    assert _paused() and not unwound
    paused.cancel()
    assert unwound == ["finally"]  # its frames were unwound where it paused
    never = SlicedEncode(encode, None, "r")
    never.cancel()  # before it ran anything: it never runs
    assert unwound == ["finally"] and not _paused()


def test_the_runners_set_forgets_a_failed_encode_and_starts_it_again():
    span = ImageSpan(0, 4, torch.zeros(1), "h")
    failing = SlicedEncodes(_fake_encode(4, [], fail_at=0), depth=4)
    with pytest.raises(ValueError):
        failing.advance(span, 1, "r")
    assert "h" not in failing
    fine = SlicedEncodes(_fake_encode(4, []), depth=4)
    assert fine.advance(span, 2, "r") is None and "h" in fine  # 2 of 4 tokens: 2 of 4 layers
    assert fine.advance(span, 2, "r").tolist() == [4.0, 4.0] and "h" not in fine


def test_layer_boundary_outside_a_sliced_encode_does_nothing():
    log: list = []
    assert _fake_encode(3, log)(None)[0].tolist() == [3.0, 3.0] and log[-1] == "after"


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(request, vl_family):
    return request.param, *vl_family(request.param)


def test_every_family_sliced_equals_whole(family):
    name, path, _ = family
    llm = engine(path, "torch")
    model = llm.engine.core.model
    prompt = mm(family_prompt(name, "what is this", 1), [make_image(3, (90, 70))])
    _, _, spans = llm.engine.inputs.process(prompt)
    with torch.inference_mode():
        whole = model.encode(spans)[0]
    depth = model.tower_depth
    assert depth > 0
    enc = SlicedEncode(model.encode, spans[0], "r")
    shares = 1
    while (feats := enc.advance(1)) is None:
        shares += 1
    assert shares == depth and enc.layers_done == depth  # one layer a share, every layer passed
    assert torch.equal(feats, whole)


def _record_batches(llm) -> list:
    batches = []
    sched = llm.engine.core.scheduler
    schedule = sched.schedule

    def recording(now, held=frozenset()):
        batch = schedule(now, held)
        batches.append(
            (
                {r.request_id: n for r, n in batch.items},
                [(r.request_id, tokens) for r, _, tokens in batch.encode_slices],
                batch.encoder_tokens,
            )
        )
        return batch

    sched.schedule = recording
    return batches


def _stream_then_image(llm, max_tokens: int = 24) -> tuple[dict[str, list[int]], str, str]:
    """A text request decoding, then an image request arriving: each one's tokens."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    text = eng.add_request("USER: tell me a long story ASSISTANT:", params)
    out: dict[str, list[int]] = {}
    for _ in range(3):
        for o in eng.step():
            out[o.request_id] = list(o.outputs[0].token_ids)
    image = eng.add_request(mm("USER: <image> what is this ASSISTANT:", [make_image(5, (64, 48))]), params)
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = list(o.outputs[0].token_ids)
    return out, text, image


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_big_image_beside_a_stream_is_sliced_and_tokens_are_unchanged(clip_llama, backend):
    # A cap of 8 prefill tokens beside decodes: the image (more than 8 embeddings) is sliced.
    base = dict(decode_step_prefill_tokens=8, max_num_batched_tokens=64)
    sliced = engine(clip_llama, backend, **base)
    batches = _record_batches(sliced)
    got, text, image = _stream_then_image(sliced)
    whole = engine(clip_llama, backend, sliced_encoding=False, **base)
    want, *_ = _stream_then_image(whole)
    assert got[text] == want[text] and got[image] == want[image]
    depth = sliced.engine.core.model.tower_depth
    slice_steps = [b for b in batches if b[1]]
    assert len(slice_steps) >= 2 and all(len(b[1]) == 1 and b[1][0][0] == image for b in slice_steps)
    for took, slices, charged in slice_steps:
        assert took.get(text) == 1  # the stream got its token in every step of the encode
        assert took.get(image, 0) <= 8  # the image's request went at most up to its image
        assert charged == slices[0][1] <= 8
    assert len(slice_steps) <= depth
    assert sliced.engine.core.runner.num_encoded_images == 1
    assert not len(sliced.engine.core.runner.features.slices) and not _paused()
    assert_all_free(sliced)


def test_an_abort_mid_encode_unwinds_it(clip_llama):
    llm = engine(clip_llama, "cpu", decode_step_prefill_tokens=8, max_num_batched_tokens=64)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    eng.add_request("USER: tell me a long story ASSISTANT:", params)
    for _ in range(3):
        eng.step()
    image = eng.add_request(mm("USER: <image> what is this ASSISTANT:", [make_image(6, (64, 48))]), params)
    eng.step()  # the first of its tower's two layers
    assert _paused() and len(eng.core.runner.features.slices)  # begun, not done
    eng.abort(image)
    while eng.has_unfinished():
        eng.step()
    assert not _paused() and not len(eng.core.runner.features.slices)
    assert eng.core.runner.num_encoded_images == 0
    assert_all_free(llm)


def test_sliced_with_async_scheduling_gives_the_same_tokens(clip_llama):
    # A step is scheduled while the one before runs: it may still give a share of an image whose
    # last share is in flight (the runner finds it done and skips it); nothing else changes.
    base = dict(decode_step_prefill_tokens=8, max_num_batched_tokens=64, async_scheduling=True)
    sliced = engine(clip_llama, "cpu", **base)
    batches = _record_batches(sliced)
    got, text, image = _stream_then_image(sliced)
    want, *_ = _stream_then_image(engine(clip_llama, "cpu", sliced_encoding=False, **base))
    assert got[text] == want[text] and got[image] == want[image]
    slice_steps = [b for b in batches if b[1]]
    assert 2 <= len(slice_steps) <= sliced.engine.core.model.tower_depth + 1
    assert sliced.engine.core.runner.num_encoded_images == 1 and not _paused()
    assert_all_free(sliced)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_background_image_alone_is_encoded_in_shares_with_nothing_else_to_run(clip_llama, async_scheduling):
    # Batch work alone: the shares are the only work of their steps (no tokens to compute), which
    # the core must still run; before it did, such a request waited forever.
    def run(sliced: bool) -> tuple[list[int], list]:
        llm = engine(clip_llama, "cpu", background_prefill_tokens=8, max_num_batched_tokens=64,
                     sliced_encoding=sliced, async_scheduling=async_scheduling)  # fmt: skip
        batches = _record_batches(llm)
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        rid = eng.add_request(mm("USER: <image> what is this ASSISTANT:", [make_image(8, (64, 48))]), params,
                              priority=10)  # fmt: skip
        tokens: list[int] = []
        for _ in range(100):
            if not eng.has_unfinished():
                break
            for o in eng.step():
                if o.request_id == rid:
                    tokens = list(o.outputs[0].token_ids)
        assert not eng.has_unfinished()
        assert_all_free(llm)
        return tokens, batches

    got, batches = run(True)
    want, _ = run(False)
    assert got == want and len(got) == 6
    assert sum(1 for took, shares, _ in batches if shares and not took) >= 2  # shares alone in a step


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_share_that_fails_fails_its_own_request(clip_llama, async_scheduling):
    # The image's request may not be among the step's items (it waits before its image): a failed
    # share must drop it, not only the requests that computed tokens in that step.
    llm = engine(clip_llama, "cpu", decode_step_prefill_tokens=8, max_num_batched_tokens=64,
                 async_scheduling=async_scheduling)  # fmt: skip
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng.add_request("USER: tell me a long story ASSISTANT:", params)
    for _ in range(3):
        eng.step()

    def broken(spans):  # fails in its second share, a step where its request computes nothing
        layer_boundary()
        layer_boundary()
        raise ValueError("tower failed")

    eng.core.runner.features.slices.encode = broken
    image = eng.add_request(mm("USER: <image> what is this ASSISTANT:", [make_image(9, (64, 48))]), params)
    dropped: set[str] = set()
    for _ in range(60):
        if not eng.has_unfinished():
            break
        try:
            eng.step()
        except StepFailedError as exc:
            dropped.update(exc.request_ids)
    assert image in dropped and not eng.has_unfinished() and not _paused()
    assert_all_free(llm)
