"""LLaVA-NeXT and LLaVA-OneVision: "anyres" images (a base tile plus the best grid of tiles,
unpadded, a learned newline after every row; OneVision shrinks large maps and tiles only a
prompt's lone image). Greedy tokens equal to transformers' `generate` on tiny random checkpoints
(every attention backend, block size 8, a budget that splits images across chunks), processing
equal to transformers', prefix and encoder reuse, chat through the template."""

from __future__ import annotations

import pytest
import torch

from helpers.families import engine, family_prompt, mm, run_batch_against
from helpers.images import make_image

FAMILIES = ["llava_next", "llava_onevision"]


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("llava_next", question, n_images)


# One image (a wide one, a large one that OneVision shrinks), two images, text only.
BATCH = [
    (prompt("what is this", 1), [make_image(1, (70, 45))], 10),
    (prompt("describe the picture", 1), [make_image(4, (200, 150))], 8),
    (prompt("which is left", 2), [make_image(2, (120, 100)), make_image(3, (20, 64))], 8),
    (prompt("how many shapes are there"), [], 9),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, vl_family):
    return request.param, *vl_family(request.param)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_transformers(family, backend):
    _, path, ref = family
    outs = run_batch_against(ref, path, backend, BATCH)
    assert max(len(o.prompt_token_ids) for o in outs) > 16  # images split across chunks


SIZES = [(70, 45), (13, 100), (150, 17), (16, 16), (97, 129), (64, 64)]


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P", "CMYK"])
@pytest.mark.parametrize("n_images", [1, 3])
def test_processing_equals_the_hf_processor(vl_family, mode, n_images):
    from transformers import AutoConfig, AutoTokenizer

    from mm_engine import models
    from mm_engine.frontend.inputs import InputProcessor

    for name in FAMILIES:
        path, ref = vl_family(name)
        tok = AutoTokenizer.from_pretrained(path)
        processing = models.make_processing(path, tok, AutoConfig.from_pretrained(path))
        inputs = InputProcessor(tok, processing, None)
        for start in range(0, len(SIZES), n_images):
            sizes = SIZES[start : start + n_images]
            images = [make_image(30 + start + i, s).convert(mode) for i, s in enumerate(sizes)]
            text = prompt("what is this", len(images))
            _, ids, spans = inputs.process(mm(text, images))
            want = ref.inputs(text, images)
            assert ids == want["input_ids"][0].tolist(), (name, sizes)
            for span, padded in zip(spans, want["pixel_values"], strict=True):
                torch.testing.assert_close(span.pixel_values, padded[: span.pixel_values.shape[0]])
                assert not padded[span.pixel_values.shape[0] :].any()  # only padding left out


def test_onevision_tiles_only_a_lone_image(vl_family):
    path, _ = vl_family("llava_onevision")
    llm = engine(path, "torch")
    img = make_image(5, (120, 100))
    _, _, alone = llm.engine.inputs.process(mm(prompt("what", 1), [img]))
    _, _, pair = llm.engine.inputs.process(mm(prompt("what", 2), [img, make_image(6)]))
    assert alone[0].pixel_values.shape[0] > 1 and pair[0].pixel_values.shape[0] == 1
    assert alone[0].content_hash != pair[0].content_hash  # never the same cached features


def test_processor_options_are_refused_by_name(vl_family):
    path, _ = vl_family("llava_next")
    with pytest.raises(ValueError, match="mm_processor_kwargs are not supported for this family: max_pixels"):
        engine(path, mm_processor_kwargs={"max_pixels": 100})
