"""Checkpoint loading: both key layouts, feature-layer options, unsupported architectures."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from helpers.images import make_image
from helpers.reference import Reference
from mm_engine import LLM, SamplingParams
from mm_engine.testing import build_checkpoint

PROMPT = "USER: <image> what is this ASSISTANT:"


def _greedy(path, n: int = 10) -> list[int]:
    llm = LLM(str(path), kv_cache_memory_bytes=4 * 1024**2)
    return (
        llm.generate(
            {"prompt": PROMPT, "multi_modal_data": {"image": make_image(5)}},
            SamplingParams(temperature=0, max_tokens=n),
        )[0]
        .outputs[0]
        .token_ids
    )


def _rewrite_keys(src, dst, rename) -> None:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    save_file({rename(k): v.contiguous() for k, v in state.items()}, dst / "model.safetensors")


def test_both_key_layouts_give_the_same_tokens(clip_llama, tmp_path):
    from pathlib import Path

    src = Path(clip_llama)
    expected = _greedy(src)

    def new_layout(k: str) -> str:  # what transformers >= 4.52 writes
        if k.startswith("language_model.model."):
            return "model.language_model." + k.removeprefix("language_model.model.")
        if k.startswith("language_model.lm_head."):
            return k.removeprefix("language_model.")
        return "model." + k

    def legacy_vision(k: str) -> str:  # original LLaVA: vision_tower.vision_model.*
        return (
            k.replace("vision_tower.", "vision_tower.vision_model.", 1)
            if k.startswith("vision_tower.")
            else k
        )

    _rewrite_keys(src, tmp_path / "new", new_layout)
    _rewrite_keys(src, tmp_path / "legacy", legacy_vision)
    assert _greedy(tmp_path / "new") == expected
    assert _greedy(tmp_path / "legacy") == expected


@pytest.mark.parametrize(("strategy", "layers"), [("full", -1), ("default", [-3, -1])])
def test_feature_layer_and_select_strategy(tmp_path, strategy, layers):
    path = build_checkpoint(
        "llava",
        tmp_path / "ck",
        vision="clip",
        text="llama",
        select_strategy=strategy,
        feature_layer=layers,
        seed=3,
    )
    ref = Reference(str(path))
    assert _greedy(path) == ref.generate(PROMPT, [make_image(5)], 10)


def test_unsupported_architecture_names_the_supported_ones(clip_llama, tmp_path):
    dst = tmp_path / "other"
    shutil.copytree(clip_llama, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["model_type"] = "gpt2"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported"):
        LLM(str(dst))


def test_missing_folder_goes_to_the_hub(monkeypatch):
    import huggingface_hub

    calls = []

    def offline(repo_id, **kwargs):
        calls.append(repo_id)
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="could not be downloaded"):
        LLM("some-org/some-llava")
    assert calls == ["some-org/some-llava"]


def test_cpu_malloc_settings_apply_once_and_are_reported():
    from mm_engine.pools import cpu_memory

    assert cpu_memory.tune_malloc() is True  # glibc, as on every Linux machine the tests run on
    assert cpu_memory.tune_malloc() is True  # idempotent


def test_kv_pool_on_huge_pages_is_aligned_and_advised_to_use_them():
    from pathlib import Path

    import torch

    from mm_engine.pools import cpu_memory
    from mm_engine.pools.kv_cache import paged_kv_tensor

    cache = paged_kv_tensor(256, 16, 2, 64, torch.float32, "cpu", cpu_memory.huge_page_empty)  # 8 MiB
    assert cache.shape == (256, 16, 2, 64) and cache.transpose(1, 2).is_contiguous()
    assert cache.data_ptr() % cpu_memory.HUGE_PAGE == 0
    cache.fill_(1.5)
    assert float(cache.sum()) == 1.5 * cache.numel()
    # Whether Linux grants 2 MiB pages at fault time depends on its free memory; what the engine
    # controls is the advice, which /proc shows as the "hg" flag of the pool's mapping.
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= cache.data_ptr() < hi
        elif inside and first == "VmFlags:":
            flags = line.split()[1:]
    assert "hg" in flags
