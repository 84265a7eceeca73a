"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE: greedy tokens equal to transformers'
`generate` on tiny random checkpoints (every attention backend, images split across prefill chunks,
preemption), M-RoPE positions and processing equal to transformers', prefix and encoder reuse, limits."""

from __future__ import annotations

import pytest
import torch

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm, run_batch_against
from helpers.images import make_image

VERSIONS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("qwen2_vl", question, n_images)


# (prompt, images, max tokens): one image, two of different sizes (one of 48 tokens, more than a
# step's budget of 16), text only.
BATCH = [
    (prompt("what is this", 1), [make_image(1, (70, 45))], 10),
    (prompt("which is left", 2), [make_image(2, (120, 100)), make_image(3, (30, 64))], 8),
    (prompt("how many shapes are there"), [], 9),
    (prompt("describe the picture", 1), [make_image(4, (40, 90))], 12),
]


@pytest.fixture(scope="module", params=VERSIONS)
def family(request, vl_family):
    return vl_family(request.param)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_transformers(family, backend):
    path, ref = family
    run_batch_against(ref, path, backend, BATCH)


def test_an_image_longer_than_the_step_budget_is_split_across_chunks(family):
    path, ref = family
    llm = engine(path, "torch")
    _, ids, spans = llm.engine.inputs.process(mm(BATCH[1][0], BATCH[1][1]))
    assert max(s.length for s in spans) > 16  # the budget: the image's tokens span several steps
    assert spans[0].length != spans[1].length


MODES = ["RGB", "L", "RGBA", "P", "LA", "CMYK", "I;16"]
SIZES = [(70, 45), (13, 200), (300, 17), (16, 16), (9, 9), (257, 129), (64, 64)]


@pytest.mark.parametrize("mode", MODES)
def test_processing_equals_the_hf_processor(vl_family, mode):
    from transformers import AutoConfig, AutoTokenizer

    from mm_engine import models
    from mm_engine.frontend.inputs import InputProcessor

    path, ref = vl_family("qwen2_5_vl")
    tok = AutoTokenizer.from_pretrained(path)
    inputs = InputProcessor(tok, models.make_processing(path, tok, AutoConfig.from_pretrained(path)), None)
    images = [make_image(20 + i, size).convert(mode) for i, size in enumerate(SIZES)]
    text = prompt("what is this", len(images))
    _, ids, spans = inputs.process(mm(text, images))
    # The processor sees the images as the engine's intake hands them on (16-bit grey scaled to 8).
    from mm_engine.vision.image_io import load_image

    want = ref.inputs(text, [load_image(i) for i in images])
    assert ids == want["input_ids"][0].tolist()
    assert [s.grid for s in spans] == [tuple(g) for g in want["image_grid_thw"].tolist()]
    assert [s.length for s in spans] == [int(g.prod()) // 4 for g in want["image_grid_thw"]]
    torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), want["pixel_values"])
    assert len({s.content_hash for s in spans}) == len(spans)


def test_mrope_positions_equal_transformers(family):
    path, ref = family
    llm = engine(path, "torch")
    for text, imgs, _ in BATCH:
        if not imgs:
            continue
        _, ids, spans = llm.engine.inputs.process(mm(text, imgs))
        mine = llm.engine.core.model.positions(ids, spans)
        inputs = ref.inputs(text, imgs)
        want, delta = ref.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
        )
        assert torch.equal(mine.prompt, want[:, 0])
        assert mine.delta == int(delta)


def test_preemption_recomputes_with_the_same_positions(family):
    path, ref = family
    # 24 blocks of 8 tokens: the batch does not fit at once, so requests are preempted and their
    # prompts and outputs recomputed (decode positions continue from the stored offset).
    memory = dict(kv_cache_memory_bytes=24 * 8192)
    if "qwen3_5" in path:  # one KV layer (4,096 bytes a block): 24 blocks after 8 state slots of 58,368
        memory = dict(kv_cache_memory_bytes=24 * 4096 + 8 * 58368, max_state_memory_fraction=0.83,
                      num_state_snapshots=0)  # fmt: skip
    llm = engine(path, "torch", image_pool_fraction=0.3, **memory)
    batch = BATCH * 2
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch], [greedy(n + 6) for *_, n in batch])
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, (text, imgs, n) in zip(outs, batch, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n + 6), text
    assert_all_free(llm)


def test_mm_processor_kwargs_per_server_and_per_request(vl_family):
    path, ref = vl_family("qwen2_vl")
    img = make_image(11, (120, 100))
    text = prompt("what is this", 1)
    small = {"max_pixels": 16 * 16 * 8}
    hf_small = {"size": {"shortest_edge": 16 * 16 * 2, "longest_edge": 16 * 16 * 8}}
    server = engine(path, mm_processor_kwargs=small)
    out = server.generate(mm(text, [img]), greedy(8))[0]
    want_ids = ref.inputs(text, [img], **hf_small)["input_ids"][0].tolist()
    assert out.prompt_token_ids == want_ids
    assert out.outputs[0].token_ids == ref.generate(text, [img], 8, **hf_small)
    # Per request, over the server's default; and the two settings never share cached features.
    llm = engine(path)
    full = llm.generate(mm(text, [img]), greedy(8))[0]
    per_request = llm.generate({**mm(text, [img]), "mm_processor_kwargs": small}, greedy(8))[0]
    assert per_request.prompt_token_ids == want_ids
    assert len(full.prompt_token_ids) > len(want_ids)
    assert llm.engine.core.runner.num_encoded_images == 2
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs option 'do_resize'"):
        llm.generate({**mm(text, [img]), "mm_processor_kwargs": {"do_resize": False}}, greedy(2))
    with pytest.raises(ValueError, match="min_pixels .* larger than max_pixels"):
        engine(path, mm_processor_kwargs={"min_pixels": 4096, "max_pixels": 1024})


def test_image_limits_are_refused_before_anything_is_allocated(vl_family):
    path, _ = vl_family("qwen2_vl")
    img = make_image(12, (120, 100))  # 48 tokens at the checkpoint's max_pixels
    text = prompt("what is this", 1)
    cases = [
        (dict(max_image_tokens=20), "max_image_tokens=20"),
        (dict(max_model_len=40), "max_model_len=40"),
        (dict(encoder_cache_bytes=4096), "encoder cache"),
        (dict(max_num_encoder_tokens=10), "encoder budget"),
    ]
    for args, match in cases:
        llm = engine(path, **args)
        with pytest.raises(ValueError, match=match):
            llm.generate(mm(text, [img]), greedy(4))
        assert_all_free(llm)
        assert llm.generate(mm(prompt("what is this"), []), greedy(3))[0].finished  # still serving
    with pytest.raises(ValueError, match="image 0: absolute aspect ratio"):
        engine(path).generate(mm(text, [make_image(1, (2, 500))]), greedy(2))


def test_default_image_cap_is_a_quarter_of_max_model_len(vl_family):
    path, _ = vl_family("qwen2_vl")
    assert engine(path, max_model_len=160).engine.core.max_image_tokens == 40
