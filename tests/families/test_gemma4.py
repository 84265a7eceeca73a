"""Gemma 4, the three published lines (mm_engine/testing/gemma4.py): `gemma4` (E2B/E4B:
per-layer embeddings, KV-sharing layers with double-wide MLPs), `gemma4_31b` (keys as values in
global layers with their own KV heads, image tokens seeing each other in the sliding layers,
clipped tower linears) and `gemma4_moe` (the 31B line with routed experts beside each MLP).
Greedy tokens equal to transformers' `generate` on each backend (block size 8, prompts past the
24-token window, variable-size images; the E line splits images across 16-token steps, the
others keep each in one step), the tower equal to transformers', the KV that the pools allocate
per layer, processing and `max_soft_tokens`, and what is refused."""

from __future__ import annotations

import pytest
import torch

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm, run_batch_against
from helpers.images import make_image

LONG = " ".join(["what is this picture"] * 8)  # longer than the sliding window


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("gemma4", question, n_images)


BATCH = [
    (prompt("what is this", 1), [make_image(1, (70, 45))], 10),
    (prompt("which is left", 2), [make_image(2, (160, 130)), make_image(3, (30, 64))], 8),
    (prompt(f"{LONG} how many shapes are there"), [], 30),
    (prompt(f"{LONG} describe the picture", 1), [make_image(4, (40, 90))], 12),
]
# A step must hold a whole image where images attend both ways (at most 70 tokens here).
BUDGET = {"gemma4": 16, "gemma4_31b": 80, "gemma4_moe": 80}


@pytest.fixture(scope="module", params=list(BUDGET))
def family(request, vl_family):
    return request.param, *vl_family(request.param)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_transformers(family, backend):
    name, path, ref = family
    run_batch_against(ref, path, backend, BATCH, max_num_batched_tokens=BUDGET[name])


def test_tower_equals_transformers(family):
    name, path, ref = family
    llm = engine(path, "torch", max_num_batched_tokens=BUDGET[name])
    model = llm.engine.core.model
    text, images = prompt("which is left", 2), BATCH[1][1]
    _, _, spans = llm.engine.inputs.process(mm(text, images))
    inputs = ref.inputs(text, images)
    with torch.inference_mode():
        got = torch.cat([e[:, 0] for e in model.encode(spans)])
        want = ref.model.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"])
    want = torch.cat(list(want.pooler_output))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))


def test_kv_only_for_the_layers_that_write_it(vl_family):
    """The E line's last two layers read earlier layers' KV and own none; the 31B line's global
    layers keep one KV head of 64 against the sliding layers' two of 32."""
    path, _ = vl_family("gemma4")
    spec = engine(path).engine.core.kv.spec
    assert spec.dims() == [(2, 32), (2, 32), (2, 64)]
    assert engine(path).engine.core.model.language_model.kv_index == [0, 1, 2, 1, 2]
    path, _ = vl_family("gemma4_31b")
    spec = engine(path, max_num_batched_tokens=80).engine.core.kv.spec
    assert spec.dims() == [(2, 32), (2, 32), (1, 64), (2, 32), (1, 64)]
    assert spec.bytes_per_block == 2 * 8 * 4 * (3 * 2 * 32 + 2 * 64)


def test_preemption_and_prefix_reuse(vl_family):
    path, ref = vl_family("gemma4")
    llm = engine(path, "cpu", image_pool_fraction=0.3, kv_cache_memory_bytes=60 * 8 * 4 * 2 * 256)
    batch = BATCH * 2
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch], [greedy(n + 6) for *_, n in batch])
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, (text, imgs, n) in zip(outs, batch, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n + 6), text
    assert_all_free(llm)


SIZES = [(70, 45), (13, 200), (300, 17), (16, 16), (9, 9), (257, 129)]


def test_processing_and_max_soft_tokens_equal_the_hf_processor(vl_family):
    path, ref = vl_family("gemma4")
    llm = engine(path)
    images = [make_image(20 + i, size) for i, size in enumerate(SIZES)]
    text = prompt("what is this", len(images))
    _, ids, spans = llm.engine.inputs.process(mm(text, images))
    want = ref.inputs(text, images)
    assert ids == want["input_ids"][0].tolist()
    real = want["image_position_ids"][..., 0] >= 0
    torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), want["pixel_values"][real])
    one = prompt("what is this", 1)
    more = {"max_soft_tokens": 140}
    out = llm.generate({**mm(one, images[:1]), "mm_processor_kwargs": more}, greedy(4))[0]
    assert out.prompt_token_ids == ref.inputs(one, images[:1], **more)["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref.generate(one, images[:1], 4, **more)
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        llm.generate({**mm(one, images[:1]), "mm_processor_kwargs": {"max_soft_tokens": 100}})
    assert_all_free(llm)


def test_audio_video_and_splits_refused_by_name(vl_family):
    path, _ = vl_family("gemma4")
    llm = engine(path)
    with pytest.raises(ValueError, match="Gemma 4 audio input is not supported"):
        llm.generate(prompt("listen <|audio|>"), greedy(2))
    path, _ = vl_family("gemma4_31b")
    with pytest.raises(ValueError, match="raise max_num_batched_tokens"):
        engine(path).generate(mm(prompt("what is this", 1), [make_image(1, (70, 45))]), greedy(2))
    from transformers import AutoConfig

    from mm_engine.parallel.group import check_divisible

    with pytest.raises(ValueError, match="does not divide layer 2's 1 KV heads"):
        check_divisible(AutoConfig.from_pretrained(path).text_config, 2)
    assert_all_free(llm)
