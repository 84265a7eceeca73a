"""Idefics3, SmolVLM, InternVL and Mistral 3 (Pixtral): images cut into tiles (plus a global image
or thumbnail) or rows of patches, runs of placeholder tokens where only some positions carry
embeddings (row/column tags, `<img>`/`</img>`, `[IMG_BREAK]`/`[IMG_END]`). Greedy tokens equal to
transformers' `generate` on tiny random checkpoints (every attention backend, block size 8, a
budget that splits images across chunks), processing equal to transformers', prefix and encoder
reuse, pool choice by embedding positions, processor options."""

from __future__ import annotations

import pytest
import torch
from conftest import make_image
from vl_helpers import assert_all_free, engine, greedy, mm

FAMILIES = ["idefics3", "smolvlm", "internvl", "mistral3"]
# InternVL3.5: the same tower with a Qwen3 language model (q/k norms).
ALL = [*FAMILIES, "internvl_qwen3"]


def prompt(family: str, question: str, n_images: int = 0) -> str:
    if family.startswith("internvl"):
        return f"<|im_start|>user {'<IMG_CONTEXT> ' * n_images}{question}<|im_end|> <|im_start|>assistant "
    if family == "mistral3":
        return f"<s>[INST]{'[IMG]' * n_images} {question}[/INST]"
    return f"<|endoftext|>User:{'<image>' * n_images} {question}<end_of_utterance>\nAssistant:"


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
def test_mixed_batch_matches_transformers(family, backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    name, path, ref = family
    llm = engine(path, backend)
    assert llm.engine.runner.backend.name == backend
    cases = batch(name)
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in cases], [greedy(n) for *_, n in cases])
    for out, (text, imgs, n) in zip(outs, cases, strict=True):
        assert out.prompt_token_ids == ref.inputs(text, imgs)["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n), text
    assert_all_free(llm)


def test_runs_carry_embeddings_only_at_image_tokens_and_pick_pools_by_them(family):
    name, path, _ = family
    llm = engine(path, "torch")
    text, imgs, _ = batch(name)[1]
    _, ids, spans = llm.engine.inputs.process(mm(text, imgs))
    image_id = llm.engine.inputs.image_token_id
    for span in spans:
        run = ids[span.offset : span.offset + span.length]
        assert span.embed_mask == tuple(t == image_id for t in run)
        assert span.num_embeds == sum(span.embed_mask) < span.length
    assert max(s.length for s in spans) > 16  # more than a step's budget: split across chunks
    from mm_engine.request import Request

    req = Request("r", ids, spans, greedy(1), 0.0, 0, frozenset())
    flags = llm.engine.blocks.image_block_flags(req)
    is_embed = [False] * len(ids)
    for span in spans:
        is_embed[span.offset : span.offset + span.length] = span.embed_mask
    assert flags == [all(is_embed[i * 8 : (i + 1) * 8]) for i in range(len(ids) // 8)]
    if name.startswith("internvl"):  # contiguous context tokens: whole blocks of them go to the image pool
        assert any(flags)


SIZES = [(70, 45), (13, 100), (150, 17), (16, 16), (9, 9), (97, 129), (64, 64)]
MODES = ["RGB", "L", "RGBA", "P", "CMYK"]


@pytest.mark.parametrize("mode", MODES)
def test_processing_equals_the_hf_processor(vl_family, mode):
    from transformers import AutoConfig, AutoTokenizer

    from mm_engine import models
    from mm_engine.inputs import InputProcessor

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
        if name == "mistral3":  # a padded batch of images of their own sizes
            for span, padded, (h, w) in zip(spans, pixels, want["image_sizes"].tolist(), strict=True):
                torch.testing.assert_close(span.pixel_values, padded[:, :h, :w])
            continue
        pixels = pixels if name.startswith("internvl") else pixels[0]
        torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), pixels)
        assert len({s.content_hash for s in spans}) == len(spans)


def test_repeated_image_reuses_prefix_and_is_encoded_once(family):
    name, path, ref = family
    llm = engine(path, "torch")
    img = make_image(9, (100, 60))
    first = [(prompt(name, "what is this", 1), [img]), (prompt(name, "what color is the circle", 1), [img])]
    outs = llm.generate([mm(p, i) for p, i in first], greedy(6))
    for out, (text, imgs) in zip(outs, first, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, 6)
    assert outs[1].num_cached_tokens > 0
    assert llm.engine.runner.num_encoded_images == 1
    late = prompt(name, f"tell me about this photo {llm.engine.inputs.image_token} please")
    out = llm.generate(mm(late, [img]), greedy(6))[0]
    assert out.outputs[0].token_ids == ref.generate(late, [img], 6)
    assert llm.engine.runner.num_encoded_images == 1
    assert_all_free(llm)


def test_chat_goes_through_the_checkpoint_template(family):
    from api_helpers import data_url, image_bytes

    name, path, ref = family
    img = make_image(7, (50, 40))
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(7, size=(50, 40)))}},
        {"type": "text", "text": "what is this"},
    ]
    out = engine(path).chat([{"role": "user", "content": parts}], greedy(8))[0]
    text = ref.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert out.prompt == text
    assert out.outputs[0].token_ids == ref.generate(text, [img], 8)


@pytest.mark.parametrize(
    ("name", "ours", "hf"),
    [
        ("idefics3", {"longest_edge": 64}, {"size": {"longest_edge": 64}}),
        ("smolvlm", {"size": {"longest_edge": 32}}, {"size": {"longest_edge": 32}}),
        ("internvl", {"max_dynamic_patch": 2}, {"max_patches": 2}),
        ("mistral3", {"longest_edge": 32}, {"size": {"longest_edge": 32}}),
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
