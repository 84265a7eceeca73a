"""GLM-4.1V, GLM-4.6V, GLM-OCR and GLM-4.5V (the MoE line): greedy tokens equal to transformers'
`generate` on tiny random checkpoints (every attention backend, images split across prefill
chunks, preemption), the tower and the M-RoPE positions against transformers', processing equal
to the checkpoint's processor, the shared layers' GLM switches (interleaved partial rotary,
sandwich norms), what is refused."""

from __future__ import annotations

import pytest
import torch

from helpers.families import (
    assert_all_free,
    assert_tower_and_positions,
    engine,
    family_prompt,
    greedy,
    mm,
    run_batch_against,
)
from helpers.images import make_image
from helpers.video import clip, mp4

VERSIONS = ["glm4v", "glm46v", "glm_ocr", "glm4v_moe"]


def prompt(question: str, n_images: int = 0) -> str:
    return family_prompt("glm4v", question, n_images)


# (prompt, images, max tokens): one image, two of different sizes (one of 48 tokens, more than a
# step's budget of 16), text only.
BATCH = [
    (prompt("what is this", 1), [make_image(1, (70, 45))], 10),
    (prompt("which is left", 2), [make_image(2, (160, 130)), make_image(3, (30, 64))], 8),
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
    grids = ref.inputs(BATCH[1][0], BATCH[1][1])["image_grid_thw"]
    assert int(grids[0].prod()) // 4 > 16  # longer than the step's budget: split across chunks


def test_tower_and_positions_equal_transformers(family):
    assert_tower_and_positions(*family, BATCH)


def test_preemption_recomputes_with_the_same_positions(vl_family):
    path, ref = vl_family("glm4v")
    llm = engine(path, "torch", image_pool_fraction=0.3, kv_cache_memory_bytes=24 * 8192)
    batch = BATCH * 2
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch], [greedy(n + 6) for *_, n in batch])
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, (text, imgs, n) in zip(outs, batch, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, n + 6), text
    assert_all_free(llm)


SIZES = [(70, 45), (13, 200), (300, 17), (16, 16), (9, 9), (257, 129)]


def test_processing_equals_the_hf_processor(vl_family):
    path, ref = vl_family("glm4v")
    llm = engine(path)
    images = [make_image(20 + i, size) for i, size in enumerate(SIZES)]
    text = prompt("what is this", len(images))
    _, ids, spans = llm.engine.inputs.process(mm(text, images))
    want = ref.inputs(text, images)
    assert ids == want["input_ids"][0].tolist()
    assert [s.grid for s in spans] == [tuple(g) for g in want["image_grid_thw"].tolist()]
    torch.testing.assert_close(torch.cat([s.pixel_values for s in spans]), want["pixel_values"])
    small = {"max_pixels": 16 * 16 * 8}
    one = prompt("what is this", 1)
    out = llm.generate({**mm(one, images[:1]), "mm_processor_kwargs": small}, greedy(4))[0]
    hf_small = {"size": {"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 8}}
    assert out.prompt_token_ids == ref.inputs(one, images[:1], **hf_small)["input_ids"][0].tolist()
    assert len(out.prompt_token_ids) < len(llm.generate(mm(one, images[:1]), greedy(1))[0].prompt_token_ids)


def test_ocr_checkpoint_skips_its_prediction_layer_and_refuses_video(vl_family):
    path, _ = vl_family("glm_ocr")
    llm = engine(path)
    assert len(llm.engine.core.model.language_model.layers) == 2  # the stored third is not loaded
    video = mp4(clip(1, 4, (32, 32)), 2)
    with pytest.raises(ValueError, match="GLM-OCR video is not supported yet"):
        llm.generate({"prompt": prompt("what is this <|video|>"), "multi_modal_data": {"video": video}})
    assert_all_free(llm)


def test_interleaved_partial_rotary_equals_transformers():
    """The shared attention's GLM switch: pairs of neighbours over half of each head, against
    transformers' own `apply_rotary_pos_emb`, seen through the dot products attention reads."""
    from transformers.models.glm4v.modeling_glm4v import apply_rotary_pos_emb

    from mm_engine.kernels.ops import TORCH_OPS
    from mm_engine.models.layers.decoder import interleaved_pairs, rotate_part

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 32, generator=g), torch.randn(5, 4, 32, generator=g)
    angles = torch.randn(5, 8, generator=g)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    pairs = interleaved_pairs(32, 16)
    ours_q, ours_k = rotate_part(TORCH_OPS, q, cos, sin, pairs), rotate_part(TORCH_OPS, k, cos, sin, pairs)
    hf_cos, hf_sin = (t[:, 0].repeat_interleave(2, -1)[None] for t in (cos, sin))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    ours = torch.einsum("thd,shd->hts", ours_q, ours_k)
    torch.testing.assert_close(ours, torch.einsum("htd,hsd->hts", want_q[0], want_k[0]))
    assert not torch.allclose(ours, torch.einsum("thd,shd->hts", q, k))  # it did turn them
