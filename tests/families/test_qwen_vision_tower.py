"""The engine's own Qwen2-VL and Qwen2.5-VL vision tower (models/layers/qwen_vision.py): its layout
(windows, segments, rotary positions) equals transformers' helpers, and its embeddings equal
transformers' tower on the same pixels (several images and a two-frame grid packed in one call),
on the torch ops and on every C kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from helpers.families import engine
from mm_engine.models.layers.qwen_vision import QwenVisionTower
from mm_engine.models.layers.vision_layout import tower_layout

# Windows that divide the grid, that do not, a one-unit-wide image, and two frames.
GRIDS = [(1, 28, 28), (1, 20, 36), (1, 16, 16), (1, 2, 30), (2, 8, 12)]


def test_layout_matches_transformers_window_index_and_positions():
    grid = torch.tensor(GRIDS)
    index, cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=112, patch_size=14)
    layout = tower_layout(GRIDS, merge=2, window=4)
    order = (index[:, None] * 4 + torch.arange(4)).flatten()
    assert torch.equal(layout.order, order)
    assert torch.equal(layout.restore, torch.argsort(index))
    ends = [s + n for s, n in zip(layout.windows.starts, layout.windows.lens, strict=True)]
    assert [0, *ends] == cu.tolist() and layout.windows.windows
    assert torch.equal(layout.positions, get_vision_position_ids(grid, 2)[order])
    assert layout.frames.lens == (784, 720, 256, 60, 96, 96) and not layout.frames.windows
    plain = tower_layout(GRIDS, merge=2)  # Qwen2-VL: no windows, patches as given
    assert plain.windows is None and plain.order is None and plain.restore is None
    assert torch.equal(plain.positions, get_vision_position_ids(grid, 2))
    with pytest.raises(ValueError, match="merge units"):
        tower_layout([(1, 5, 4)], merge=2)


@pytest.mark.parametrize(
    "version", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tower_embeddings_equal_transformers(vl_family, version, backend):
    path, ref = vl_family(version)
    kwargs = {"cpu_kernels": "all"} if backend == "cpu" else {}
    llm = engine(path, backend, **kwargs)
    ours = llm.engine.core.model.visual
    assert isinstance(ours, QwenVisionTower)
    assert not any(isinstance(m, PreTrainedModel) for m in ours.modules())
    theirs = ref.model.model.visual
    cfg = theirs.config
    grids = [(1, 4, 8), (1, 12, 4), (2, 8, 8), (1, 2, 12), (1, 10, 10)]
    per_patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), per_patch, generator=g)
    with torch.inference_mode():
        want = theirs(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids).pooler_output
    assert (
        got.shape
        == want.shape
        == (sum(t * h * w for t, h, w in grids) // 4, llm.engine.core.model.config.text_config.hidden_size)
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    features = theirs(pixels, grid_thw=torch.tensor(grids))
    deepstack = getattr(features, "deepstack_features", None) or []
    assert len(ours(pixels, grids).deepstack_features) == len(deepstack)
    for mine, reference in zip(ours(pixels, grids).deepstack_features, deepstack, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
    llm.close()


def test_bfloat16_tower_on_cpu_stays_close_and_the_engine_serves(vl_family):
    """`vision_dtype="bfloat16"` (oneDNN's bf16 GEMM where the CPU has AVX-512 BF16, torch's
    elsewhere): the C kernels decline bf16 and torch answers; features within bf16 rounding of
    float32's, and a request runs to its end with every block free again."""
    from helpers.families import assert_all_free, family_prompt, greedy, mm
    from helpers.images import make_image

    path, ref = vl_family("qwen2_5_vl")
    llm = engine(path, "cpu", vision_dtype="bfloat16")
    ours = llm.engine.core.model.visual
    assert ours.merger.ln_q.weight.dtype == torch.bfloat16
    grids = [(1, 4, 8), (1, 8, 8)]
    pixels = torch.randn(96, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = ref.model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids).pooler_output.float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    out = llm.generate(
        [mm(family_prompt("qwen2_5_vl", "what is this", 1), [make_image(1, (70, 45))])], greedy(5)
    )
    assert len(out[0].outputs[0].token_ids) == 5
    assert_all_free(llm)
    llm.close()
