"""PaddleOCR-VL on a tiny random checkpoint (mm_engine/testing/paddleocr.py): greedy tokens equal to
transformers' `generate` on each backend (block size 8, a 16-token step budget that splits
images across chunks), the tower and projector equal to transformers', M-RoPE positions equal to
`get_rope_index`, processing equal to the HF processor, video refused by name."""

from __future__ import annotations

import pytest

from helpers.families import (
    assert_all_free,
    assert_tower_and_positions,
    engine,
    family_prompt,
    run_batch_against,
)
from helpers.images import make_image


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("paddleocr_vl", question, n_images)


BATCH = [
    (prompt("OCR:", 1), [make_image(1, (70, 45))], 10),
    (prompt("which is left", 2), [make_image(2, (160, 130)), make_image(3, (30, 64))], 8),
    (prompt("how many shapes are there"), [], 9),
    (prompt("describe the picture", 1), [make_image(4, (40, 90))], 12),
]


@pytest.fixture(scope="module")
def paddle(vl_family):
    return vl_family("paddleocr_vl")


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_matches_transformers(paddle, backend):
    path, ref = paddle
    run_batch_against(ref, path, backend, BATCH)
    grids = ref.inputs(BATCH[1][0], BATCH[1][1])["image_grid_thw"]
    assert int(grids[0].prod()) // 4 > 16  # longer than the step's budget: split across chunks


def test_tower_positions_and_processing_equal_transformers(paddle):
    assert_tower_and_positions(*paddle, BATCH)


def test_video_refused_by_name(paddle):
    path, _ = paddle
    llm = engine(path)
    with pytest.raises(ValueError, match="PaddleOCR-VL video is not supported yet"):
        llm.generate(prompt("what is this <|video_pad|>"))
    assert_all_free(llm)
