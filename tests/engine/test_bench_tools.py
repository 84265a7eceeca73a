"""The benchmark tools measure what they say: FLOP counts agree with torch's own counter on the
Hugging Face model, and bench.offline / bench.roofline / bench.report run end to end on a tiny
checkpoint (no timing is checked, only that the figures are there and consistent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, LlavaForConditionalGeneration

from bench import offline, report, roofline
from bench.machine import LlavaFlops, qwen_tower_flops
from mm_engine import LLM


@pytest.fixture(autouse=True)
def _runs_in_process(monkeypatch):
    """The bench tools' runs stay in this process: the same code without a spawn and an import of
    torch and transformers per run (their isolation only matters to the figures)."""
    monkeypatch.setenv("MM_ENGINE_BENCH_IN_PROCESS", "1")


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("fixture", ["clip_llama", "siglip_qwen2"])
def test_flop_counts_match_torch_flop_counter(fixture, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    cfg = AutoConfig.from_pretrained(path)
    flops = LlavaFlops.from_config(cfg)
    # Vision: what the engine's own tower and projector run for one image. (FlopCounterMode counts
    # aten matmuls and SDPA: the torch ops, not the C kernels or packed oneDNN linears.)
    engine_model = LLM(
        path, kv_cache_memory_bytes=4 * 1024**2, cpu_packed_weights=False, attention_backend="torch"
    ).engine.core.model

    def eager(q, k, v, scale):  # attention as plain matmuls: the counter does not see CPU SDPA's
        return torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", eager)
    size = cfg.vision_config.image_size
    vision = _counted(lambda: engine_model.encode_images(torch.zeros(1, 3, size, size)))
    assert vision == pytest.approx(flops.vision_per_image, rel=1e-9)

    # One decode token with 5 cached tokens: linear layers, attention over 6 keys, the head.
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"
    lm = model.model.language_model
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        cache = lm(input_ids=ids, use_cache=True).past_key_values
        one = _counted(lambda: model(input_ids=torch.tensor([[10]]), past_key_values=cache, logits_to_keep=1))
    assert one == pytest.approx(flops.tokens(5, 1) + flops.lm_head_per_token, rel=1e-9)


@pytest.mark.parametrize("version", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_tower_flops_match_torch_flop_counter(version):
    """transformers' tower (its SDPA per frame or window, as plain matmuls under "eager") on two
    images, one whose grid the windows do not divide."""
    from mm_engine.testing.qwen import reference_tower_class

    dims = dict(depth=3, num_heads=2, patch_size=14, spatial_merge_size=2)
    if version == "qwen2_5_vl":
        dims.update(
            hidden_size=64,
            intermediate_size=96,
            out_hidden_size=48,
            window_size=56,
            fullatt_block_indexes=[1],
        )
    else:
        dims.update(embed_dim=64, mlp_ratio=2, hidden_size=48)
    config = AutoConfig.for_model(version, vision_config=dims).vision_config
    config._attn_implementation = "eager"
    tower = reference_tower_class(version)._from_config(config).eval()
    grids = [(1, 12, 20), (1, 8, 8)]
    per_patch = 3 * 2 * 14 * 14
    pixels = torch.zeros(sum(t * h * w for t, h, w in grids), per_patch)
    with torch.inference_mode():
        counted = _counted(lambda: tower(pixels, grid_thw=torch.tensor(grids)))
    assert counted == pytest.approx(sum(qwen_tower_flops(config, g) for g in grids), rel=1e-9)


@pytest.mark.slow
@pytest.mark.subprocess
def test_offline_roofline_and_report_end_to_end(clip_llama, tmp_path, capsys):
    res = offline.main(
        ["--model", clip_llama, "--num-images", "3", "--hf-batch-size", "2", "--check", "3",
         "--threads", "1", "--kv-cache-memory-bytes", str(8 * 1024**2), "--profile", "--rate-sizes", "128",
         "--json", str(tmp_path / "offline_caption.json")]
    )  # fmt: skip
    assert res["tokens_identical"] == "3/3"  # the same greedy tokens as transformers
    assert res["num_requests"] == 3 and res["output_tokens"] > 0
    assert res["throughput_ratio"] == pytest.approx(res["hf_seconds"] / res["engine_seconds"])
    assert res["compute_floor_fraction"] > 0 and res["hf_compute_floor_fraction"] > 0
    # Each run is held to the matmul rate measured next to it, in its own process.
    assert len(res["engine_run_matmul_gflops_per_s"]) == 2 and res["hf_run_matmul_gflops_per_s"] > 0
    assert set(res["profile_shares"]) >= {"vision", "prefill", "decode", "sampling", "scheduling"}
    assert sum(res["profile_shares"].values()) == pytest.approx(1.0)
    saved = json.loads((tmp_path / "offline_caption.json").read_text())
    for key in (
        "workload",
        "engine_images_per_s",
        "hf_images_per_s",
        "throughput_ratio",
        "compute_floor_fraction",
    ):
        assert key in saved

    roof = roofline.main(
        ["--model", clip_llama, "--batch-sizes", "1,3", "--context", "8", "--steps", "2", "--threads", "1",
         "--json", str(tmp_path / "roofline.json")]
    )  # fmt: skip
    assert [r["batch"] for r in roof["rows"]] == [1, 3]
    assert all(r["fraction_of_roofline"] > 0 for r in roof["rows"])
    assert roof["blocks_held_after"] == {"text": 0, "image": 0}  # aborted requests freed their blocks
    assert "| batch |" in capsys.readouterr().out

    # bench.memory and bench.serve JSON as their last real runs wrote it (bench/results).
    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    for name in ("memory.json", "serve.json"):
        shutil.copy(results / name, tmp_path / name)
    written = report.main(["--results", str(tmp_path)])
    assert sorted(p.name for p in written) == ["memory.png", "offline.png", "roofline.png", "serve.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


@pytest.mark.slow
def test_offline_json_schema_measures_structured_output_side_by_side(tmp_path):
    from mm_engine.testing import build_checkpoint

    model = build_checkpoint("llava", tmp_path / "bytes", byte_level=True)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    res = offline.main(
        ["--model", str(model), "--json-schema", str(tmp_path / "schema.json"), "--num-images", "4",
         "--threads", "1", "--kv-cache-memory-bytes", str(8 * 1024**2), "--rate-sizes", "128",
         "--json", str(tmp_path / "so.json")]
    )  # fmt: skip
    assert res["mode"] == "json_schema" and res["num_requests"] == 4 and len(res["free_seconds_runs"]) == 2
    assert res["json_schema_completed"] >= 1 and res["json_schema_valid"] == res["json_schema_completed"]
    assert res["free_output_tokens"] > res["json_schema_output_tokens"] > 0  # the grammar ends them early
    expected = res["free_output_tokens_per_s"] / res["json_schema_output_tokens_per_s"] - 1
    assert res["overhead_per_token"] == pytest.approx(expected)
    assert json.loads((tmp_path / "so.json").read_text())["overhead_per_token"] == res["overhead_per_token"]


def test_towers_bench_runs_every_fixed_size_family_and_pixtral_equal_to_transformers(monkeypatch, tmp_path):
    """bench.towers at toy sizes: a row per case, each engine tower's output equal to
    transformers' on the pixels it timed."""
    from bench import towers

    monkeypatch.setattr(towers, "BASE", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2))  # fmt: skip
    monkeypatch.setattr(towers, "VIT_CASES", [(112, 1), (112, 3)])
    monkeypatch.setattr(towers, "PIXTRAL_CASES", [[(32, 32)], [(32, 48), (16, 64)]])
    families = [*towers.VIT_FAMILIES, "pixtral"]
    out = towers.main(["--reps", "1", "--families", ",".join(families), "--json", str(tmp_path / "t.json")])
    assert [r["family"] for r in out["rows"]] == [f for f in towers.VIT_FAMILIES for _ in "ab"] + [
        "pixtral"
    ] * 2
    assert all(r["max_abs_diff"] < 1e-4 and r["engine_vs_transformers"] > 0 for r in out["rows"])
    assert out["rows"][-1]["grids"] == [[2, 3], [1, 4]]
    assert json.loads((tmp_path / "t.json").read_text())["rows"] == out["rows"]


def test_layer_decode_bench_compares_both_engines_on_equal_tokens(vl_family, tmp_path, capsys):
    from bench import layer_decode

    path, _ = vl_family("qwen3_5")
    out = tmp_path / "layer_decode.json"
    args = ["--models", path, "--settings", "fp32,int4", "--batch-sizes", "1,2", "--rounds", "1"]
    res = layer_decode.main([*args, "--steps", "2", "--json", str(out)])
    assert [r["setting"] for r in res["rows"]] == ["fp32", "int4"]
    assert all(r["tokens_equal"] and set(r["steps"]) == {1, 2} for r in res["rows"])
    assert all(s["off_ms"] > 0 and s["on_ms"] > 0 for r in res["rows"] for s in r["steps"].values())
    assert "without / with" in capsys.readouterr().out and json.loads(out.read_text())["rows"]
