"""Idefics3, SmolVLM, InternVL, Mistral 3 and LightOnOCR (Pixtral): images cut into tiles (plus a global image
or thumbnail) or rows of patches, runs of placeholder tokens where only some positions carry
embeddings (row/column tags, `<img>`/`</img>`, `[IMG_BREAK]`/`[IMG_END]`). Greedy tokens equal to
transformers' `generate` on tiny random checkpoints (every attention backend, block size 8, a
budget that splits images across chunks), processing equal to transformers', prefix and encoder
reuse, pool choice by embedding positions, processor options."""

from __future__ import annotations

import pytest
import torch

from helpers.families import assert_all_free, engine, greedy, mm, run_batch_against
from helpers.families import family_prompt as prompt
from helpers.images import make_image

FAMILIES = ["idefics3", "smolvlm", "internvl", "mistral3", "lighton_ocr"]
# InternVL3.5: the same tower with a Qwen3 language model (q/k norms).
ALL = [*FAMILIES, "internvl_qwen3"]


def batch(family: str) -> list[tuple[str, list, int]]:
    """One image, two of different sizes and tile grids, text only."""
    return [
        (prompt(family, "what is this", 1), [make_image(1, (70, 45))], 10),
        (prompt(family, "which is left", 2), [make_image(2, (120, 100)), make_image(3, (20, 64))], 8),
        (prompt(family, "how many shapes are there"), [], 9),
        (prompt(family, "describe the picture", 1), [make_image(4, (30, 30))], 12),
    ]


@pytest.fixture(scope="module", params=ALL)
def family(request, vl_family):
    return request.param, *vl_family(request.param)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_transformers(family, backend):
    name, path, ref = family
    run_batch_against(ref, path, backend, batch(name))


def test_runs_carry_embeddings_only_at_image_tokens_and_pick_pools_by_them(family):
    name, path, _ = family
    llm = engine(path, "torch")
    text, imgs, _ = batch(name)[1]
    _, ids, spans = llm.engine.inputs.process(mm(text, imgs))
    image_id = llm.engine.inputs.image_token_id
    for span in spans:
        run = ids[span.offset : span.offset + span.length]
        if span.embed_mask is None:  # LightOnOCR: image tokens only, every one an embedding
            assert set(run) == {image_id} and span.num_embeds == span.length
            continue
        assert span.embed_mask == tuple(t == image_id for t in run)
        assert span.num_embeds == sum(span.embed_mask) < span.length
    assert max(s.length for s in spans) > 16  # more than a step's budget: split across chunks
    from mm_engine.request import Request

    req = Request("r", ids, spans, greedy(1), 0.0, 0, frozenset())
    flags = llm.engine.core.blocks.image_block_flags(req)
    is_embed = [False] * len(ids)
    for span in spans:
        is_embed[span.offset : span.offset + span.length] = span.embed_mask or [True] * span.length
    assert flags == [all(is_embed[i * 8 : (i + 1) * 8]) for i in range(len(ids) // 8)]
    if name.startswith("internvl") or name == "lighton_ocr":  # whole blocks of embeddings: the image pool
        assert any(flags)


SIZES = [(70, 45), (13, 100), (150, 17), (16, 16), (9, 9), (97, 129), (64, 64)]
MODES = ["RGB", "L", "RGBA", "P", "CMYK"]


@pytest.mark.parametrize("mode", MODES)
def test_processing_equals_the_hf_processor(vl_family, mode):
    from transformers import AutoConfig, AutoTokenizer

    from mm_engine import models
    from mm_engine.frontend.inputs import InputProcessor

    for name in FAMILIES:
        path, ref = vl_family(name)
        tok = AutoTokenizer.from_pretrained(path)
        inputs = InputProcessor(
            tok, models.make_processing(path, tok, AutoConfig.from_pretrained(path)), None
        )
        images = [make_image(30 + i, size).convert(mode) for i, size in enumerate(SIZES)]
        text = prompt(name, "what is this", len(images))
        _, ids, spans = inputs.process(mm(text, images))
        want = ref.inputs(text, images)
        assert ids == want["input_ids"][0].tolist(), name
        pixels = want["pixel_values"]
        if name in ("mistral3", "lighton_ocr"):  # a padded batch of images of their own sizes
            for span, padded, (h, w) in zip(spans, pixels, want["image_sizes"].tolist(), strict=True):
                torch.testing.assert_close(span.pixel_values, padded[:, :h, :w])
            continue
        pixels = pixels if name.startswith("internvl") else pixels[0]
        torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), pixels)
        assert len({s.content_hash for s in spans}) == len(spans)


@pytest.mark.parametrize(
    ("name", "ours", "hf"),
    [
        ("idefics3", {"longest_edge": 64}, {"size": {"longest_edge": 64}}),
        ("smolvlm", {"size": {"longest_edge": 32}}, {"size": {"longest_edge": 32}}),
        ("internvl", {"max_dynamic_patch": 2}, {"max_patches": 2}),
        ("mistral3", {"longest_edge": 32}, {"size": {"longest_edge": 32}}),
        ("lighton_ocr", {"longest_edge": 48}, {"size": {"longest_edge": 48}}),
    ],
)
def test_mm_processor_kwargs(vl_family, name, ours, hf):
    path, ref = vl_family(name)
    img = make_image(11, (120, 100))
    text = prompt(name, "what is this", 1)
    server = engine(path, mm_processor_kwargs=ours)
    out = server.generate(mm(text, [img]), greedy(6))[0]
    assert out.prompt_token_ids == ref.inputs(text, [img], **hf)["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref.generate(text, [img], 6, **hf)
    llm = engine(path)
    per_request = llm.generate({**mm(text, [img]), "mm_processor_kwargs": ours}, greedy(6))[0]
    assert per_request.prompt_token_ids == out.prompt_token_ids
    assert len(llm.generate(mm(text, [img]), greedy(1))[0].prompt_token_ids) > len(out.prompt_token_ids)
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs option 'max_pixels'"):
        llm.generate({**mm(text, [img]), "mm_processor_kwargs": {"max_pixels": 100}}, greedy(2))
    assert_all_free(llm)


def test_bench_offline_ocr_workload(vl_family, monkeypatch):
    """`bench.offline --workload ocr`: document pages (1240 x 1754) against transformers."""
    from bench import offline

    monkeypatch.setenv("MM_ENGINE_BENCH_IN_PROCESS", "1")  # its runs without a spawn each
    path, _ = vl_family("lighton_ocr")
    res = offline.main(
        ["--model", path, "--workload", "ocr", "--num-images", "2", "--hf-batch-size", "2", "--check", "2",
         "--threads", "1", "--kv-cache-memory-bytes", str(8 * 1024**2), "--rate-sizes", "128"]
    )  # fmt: skip
    assert res["tokens_identical"] == "2/2" and res["workload"] == "ocr"
