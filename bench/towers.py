"""Vision towers alone: the engine's own against transformers' on the same weights and pixels.

Per family whose tower the engine implements, at the benchmark model's tower size (SigLIP-base:
12 layers of 768, 12 heads), for a few image sizes and batch sizes: seconds per call of
- transformers' tower as a user runs it (SDPA, `nn.Linear`),
- the same module as the engine ran it before it had its own (its linears packed for oneDNN, its
  attention and activations through the engine's ops where enabled),
- the engine's tower (models/layers/qwen_vision.py, vit_tower.py for LLaVA's CLIP and SigLIP) on
  the platform's ops,
and the engine's output against transformers' (max abs difference). Ratios are side by side in
one process; the figures name the CPU. `--dtype bfloat16` runs every contender in bf16 (on a CPU
with AVX-512 BF16, oneDNN's bf16 GEMM).

    python -m bench.towers [--json bench/results/towers.json]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig

from bench.machine import best_seconds, machine_info
from bench.save import save_json
from bench.vlm import IMAGE_SIZE, PATCH, QWEN35_VISION_DIMS, QWEN_VISION_DIMS, VISION_DIMS
from mm_engine.models.layers.packed_linear import pack_linears
from mm_engine.models.layers.qwen_vision import QwenVisionTower
from mm_engine.models.layers.vit_tower import VitTower, tower_state
from mm_engine.models.platform import adapt_vision_tower, make_platform
from mm_engine.testing.qwen import reference_tower_class

# (family, vision config overrides): the benchmark model's tower, and Qwen2-VL's at the same size.
FAMILIES = {
    "qwen2_5_vl": dict(QWEN_VISION_DIMS, patch_size=14),
    "qwen2_vl": dict(depth=12, embed_dim=768, num_heads=12, mlp_ratio=4, hidden_size=576, patch_size=14),
    "qwen3_5": dict(QWEN35_VISION_DIMS, patch_size=14),  # patch 14 here, so that the image sizes match
}
# (patch rows, patch columns, images per call): 224 px, 448 px and 896 x 672 px images.
CASES = [(16, 16, 1), (16, 16, 4), (16, 16, 16), (32, 32, 1), (32, 32, 4), (64, 48, 1)]
# LLaVA's towers (fixed size: the benchmark model's 224 px, patch 16): all 12 blocks read.
VIT_FAMILIES = {
    "siglip": dict(VISION_DIMS, image_size=IMAGE_SIZE, patch_size=PATCH),
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 image_size=IMAGE_SIZE, patch_size=PATCH),
}  # fmt: skip
VIT_IMAGES = [1, 4, 16]


def towers(family: str, dtype: torch.dtype, platform):
    """transformers' tower with random weights, the same adapted as the engine used to, and the
    engine's own with the same weights."""
    config = AutoConfig.for_model(family, vision_config=FAMILIES[family]).vision_config
    torch.manual_seed(0)
    plain = reference_tower_class(family)._from_config(config).to(dtype).eval().requires_grad_(False)
    state = plain.state_dict()
    adapted = reference_tower_class(family)._from_config(config).to(dtype).eval().requires_grad_(False)
    adapted.load_state_dict(state)
    adapt_vision_tower(adapted, platform)
    pack_linears(adapted)
    ours = QwenVisionTower(config, platform.ops).to(dtype).eval().requires_grad_(False)
    ours.load_state_dict(QwenVisionTower.checkpoint_state(state), strict=False)
    ours.fuse()
    pack_linears(ours)
    return config, plain, adapted, ours


def vit_towers(kind: str, dtype: torch.dtype, platform):
    """The same for a CLIP or SigLIP tower as LLaVA reads it (the last block's hidden states)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

    config_cls, model_cls = {"siglip": (SiglipVisionConfig, SiglipVisionModel),
                             "clip": (CLIPVisionConfig, CLIPVisionModel)}[kind]  # fmt: skip
    config = config_cls(**VIT_FAMILIES[kind])
    torch.manual_seed(0)
    plain = model_cls._from_config(config).to(dtype).eval().requires_grad_(False)
    state = plain.state_dict()
    adapted = model_cls._from_config(config).to(dtype).eval().requires_grad_(False)
    adapted.load_state_dict(state)
    adapt_vision_tower(adapted, platform)
    pack_linears(adapted)
    depth = config.num_hidden_layers
    ours = VitTower(config, [depth], platform.ops).to(dtype).eval().requires_grad_(False)
    ours.load_state_dict(tower_state({k.removeprefix("vision_model."): v for k, v in state.items()}, depth))
    pack_linears(ours)
    return config, plain, adapted, ours


def run_vit(kind: str, dtype: torch.dtype, reps: int, platform) -> list[dict]:
    config, plain, adapted, ours = vit_towers(kind, dtype, platform)
    rows, size, depth = [], config.image_size, config.num_hidden_layers
    for n in VIT_IMAGES:
        pixels = torch.randn(n, 3, size, size).to(dtype)
        with torch.inference_mode():
            want = plain(pixels, output_hidden_states=True).hidden_states[depth]
            diff = (ours(pixels)[0] - want).abs().max().item()
            calls = {
                "transformers": lambda f=plain, x=pixels: f(x, output_hidden_states=True),
                "transformers_adapted": lambda f=adapted, x=pixels: f(x, output_hidden_states=True),
                "engine": lambda f=ours, x=pixels: f(x),
            }
            seconds = {name: best_seconds(call, reps) for name, call in calls.items()}
        rows.append(_row(kind, [size // config.patch_size] * 2, n, seconds, diff))
    return rows


def _row(family: str, patches: list[int], n: int, seconds: dict, diff: float) -> dict:
    row = {
        "family": family, "image_patches": patches, "images": n, "seconds": seconds,
        "engine_vs_transformers": seconds["transformers"] / seconds["engine"],
        "engine_vs_adapted": seconds["transformers_adapted"] / seconds["engine"],
        "max_abs_diff": diff,
    }  # fmt: skip
    print(
        f"{family:11s} {patches[0]}x{patches[1]} patches x{n:<3d}"
        f" transformers {seconds['transformers']:7.3f} s"
        f"  adapted {seconds['transformers_adapted']:7.3f} s  engine {seconds['engine']:7.3f} s"
        f"  x{row['engine_vs_transformers']:.2f} / x{row['engine_vs_adapted']:.2f}  diff {diff:.1e}",
        flush=True,
    )
    return row


def run(dtype: torch.dtype, reps: int, platform, families: list[str]) -> list[dict]:
    rows = []
    for family in families:
        if family in VIT_FAMILIES:
            rows += run_vit(family, dtype, reps, platform)
            continue
        config, plain, adapted, ours = towers(family, dtype, platform)
        per_patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        for h, w, n in CASES:
            grids = [(1, h, w)] * n
            pixels = torch.randn(n * h * w, per_patch).to(dtype)
            grid = torch.tensor(grids)
            with torch.inference_mode():
                want = plain(pixels, grid_thw=grid).pooler_output
                diff = (ours(pixels, grids).pooler_output - want).abs().max().item()
                calls = {
                    "transformers": lambda f=plain, x=pixels, g=grid: f(x, grid_thw=g),
                    "transformers_adapted": lambda f=adapted, x=pixels, g=grid: f(x, grid_thw=g),
                    "engine": lambda f=ours, x=pixels, g=grids: f(x, g),
                }
                seconds = {name: best_seconds(call, reps) for name, call in calls.items()}
            rows.append(_row(family, [h, w], n, seconds, diff))
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reps", type=int, default=2)
    names = [*FAMILIES, *VIT_FAMILIES]
    ap.add_argument("--families", default=",".join(names), help="comma-separated: " + ", ".join(names))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    platform = make_platform(torch.device("cpu"), "cpu")
    result = {
        "dtype": args.dtype,
        "platform": platform.info(),
        "rows": run(getattr(torch, args.dtype), args.reps, platform, args.families.split(",")),
        "machine": machine_info(),
    }
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
