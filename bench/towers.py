"""Vision towers alone: the engine's own against transformers' on the same weights and pixels.

Per family whose tower the engine implements, at SigLIP-base size (12 blocks of 768, 12 heads;
the Qwen towers at the benchmark model's), for a few image sizes and batch sizes: seconds per call
of transformers' tower as a user runs it (SDPA, `nn.Linear`) and of the engine's (models/layers/
qwen_vision.py, vit_tower.py, pixtral_tower.py) on the platform's ops with packed weights, and the
engine's output against transformers' (max abs difference). Ratios are side by side in one
process; the figures name the CPU. `--dtype bfloat16` runs both in bf16 (on a CPU with AVX-512
BF16, oneDNN's bf16 GEMM).

    python -m bench.towers [--families siglip,pixtral] [--json bench/results/towers.json]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from transformers import AutoConfig

from bench.machine import best_seconds, machine_info
from bench.save import save_json
from bench.vlm import QWEN35_VISION_DIMS, QWEN_VISION_DIMS
from mm_engine.models.layers.packed_linear import pack_linears
from mm_engine.models.layers.pixtral_tower import PixtralTower, pixtral_state
from mm_engine.models.layers.qwen_vision import QwenVisionTower
from mm_engine.models.layers.vit_tower import VitTower, tower_state
from mm_engine.models.platform import make_platform
from mm_engine.testing.qwen import reference_tower_class

# (family, vision config overrides): the benchmark model's tower, and Qwen2-VL's at the same size.
FAMILIES = {
    "qwen2_5_vl": dict(QWEN_VISION_DIMS, patch_size=14),
    "qwen2_vl": dict(depth=12, embed_dim=768, num_heads=12, mlp_ratio=4, hidden_size=576, patch_size=14),
    "qwen3_5": dict(QWEN35_VISION_DIMS, patch_size=14),  # patch 14 here, so that the image sizes match
}
# (patch rows, patch columns, images per call): 224 px, 448 px and 896 x 672 px images.
CASES = [(16, 16, 1), (16, 16, 4), (16, 16, 16), (32, 32, 1), (32, 32, 4), (64, 48, 1)]
BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
# Fixed-resolution towers, each as its family reads it: (transformers model class, engine kind,
# patch, the final norm applied). LLaVA's CLIP/SigLIP read the last block's hidden states; Gemma 3
# and Idefics3/SmolVLM add the post-norm; InternVL (mean pooling on) reads the last block.
VIT_FAMILIES = {
    "clip": ("CLIPVisionModel", "clip", 16, False),
    "siglip": ("SiglipVisionModel", "siglip", 16, False),
    "gemma3": ("SiglipVisionModel", "siglip", 16, True),
    "idefics3": ("Idefics3VisionTransformer", "navit", 16, True),
    "internvit": ("InternVLVisionModel", "internvit", 14, False),
}
VIT_CASES = [(224, 1), (224, 4), (224, 16), (448, 1), (448, 4)]  # (image side, images per call)
# Pixtral takes images at their own sizes: (height, width) of each image of a call.
PIXTRAL_CASES = [[(224, 224)], [(224, 224)] * 4, [(224, 224)] * 16, [(448, 448)], [(448, 448)] * 4,
                 [(448, 320), (224, 336), (512, 512), (160, 640)]]  # fmt: skip


def qwen_towers(family: str, dtype: torch.dtype, platform):
    """transformers' tower with random weights and the engine's own with the same weights."""
    config = AutoConfig.for_model(family, vision_config=FAMILIES[family]).vision_config
    torch.manual_seed(0)
    plain = reference_tower_class(family)._from_config(config).to(dtype).eval().requires_grad_(False)
    ours = QwenVisionTower(config, platform.ops).to(dtype).eval().requires_grad_(False)
    ours.load_state_dict(QwenVisionTower.checkpoint_state(plain.state_dict()), strict=False)
    ours.fuse()
    pack_linears(ours)
    return config, plain, ours


def vit_towers(family: str, side: int, dtype: torch.dtype, platform):
    """A fixed-resolution family's transformers tower at `side` pixels, the engine's with the
    same weights, and the transformers output the engine's must equal."""
    import transformers

    class_name, kind, patch, post_norm = VIT_FAMILIES[family]
    model_cls = getattr(transformers, class_name)
    size = [side, side] if kind == "internvit" else side
    config = model_cls.config_class(
        **BASE, image_size=size, patch_size=[patch] * 2 if kind == "internvit" else patch
    )
    if kind == "siglip":
        config.vision_use_head = False  # the pooling head no family reads
    torch.manual_seed(0)
    plain = model_cls._from_config(config).to(dtype).eval().requires_grad_(False)
    depth = config.num_hidden_layers
    ours = VitTower(config, [depth], platform.ops, post_norm=post_norm).to(dtype).eval().requires_grad_(False)
    state = {k.removeprefix("vision_model."): v for k, v in plain.state_dict().items()}
    ours.load_state_dict(tower_state(state, depth, kind, post_norm))
    pack_linears(ours)

    def reference(pixels: torch.Tensor) -> torch.Tensor:
        out = plain(pixel_values=pixels, output_hidden_states=not post_norm)
        return out.last_hidden_state if post_norm or kind == "internvit" else out.hidden_states[depth]

    return reference, ours


def pixtral_towers(dtype: torch.dtype, platform):
    from transformers import PixtralVisionConfig, PixtralVisionModel

    head_dim = BASE["hidden_size"] // BASE["num_attention_heads"]
    config = PixtralVisionConfig(**BASE, head_dim=head_dim, patch_size=16, image_size=1024)
    torch.manual_seed(0)
    plain = PixtralVisionModel._from_config(config).to(dtype).eval().requires_grad_(False)
    ours = (
        PixtralTower(config, [config.num_hidden_layers], platform.ops).to(dtype).eval().requires_grad_(False)
    )
    ours.load_state_dict(pixtral_state(plain.state_dict(), config.num_hidden_layers))
    ours.fuse()
    pack_linears(ours)
    return plain, ours


def _time(theirs, ours, reps: int) -> dict:
    """Best seconds of transformers' call and the engine's, each a function of no arguments."""
    return {"transformers": best_seconds(theirs, reps), "engine": best_seconds(ours, reps)}


def run_vit(family: str, dtype: torch.dtype, reps: int, platform) -> list[dict]:
    rows, patch = [], VIT_FAMILIES[family][2]
    for side in dict.fromkeys(s for s, _ in VIT_CASES):
        reference, ours = vit_towers(family, side, dtype, platform)
        for n in (n for s, n in VIT_CASES if s == side):
            pixels = torch.randn(n, 3, side, side).to(dtype)
            with torch.inference_mode():
                diff = (ours(pixels)[0] - reference(pixels)).abs().max().item()
                seconds = _time(partial(reference, pixels), partial(ours, pixels), reps)
            rows.append(_row(family, [[side // patch] * 2] * n, seconds, diff))
    return rows


def run_pixtral(dtype: torch.dtype, reps: int, platform) -> list[dict]:
    plain, ours = pixtral_towers(dtype, platform)
    rows, patch = [], plain.config.patch_size
    for sizes in PIXTRAL_CASES:
        images = [torch.randn(3, h, w).to(dtype) for h, w in sizes]
        padded = torch.zeros(len(images), 3, max(h for h, _ in sizes), max(w for _, w in sizes), dtype=dtype)
        for i, (h, w) in enumerate(sizes):
            padded[i, :, :h, :w] = images[i]
        image_sizes = torch.tensor(sizes)
        with torch.inference_mode():
            want = plain(padded, image_sizes=image_sizes).last_hidden_state[0]
            diff = (ours(images)[0] - want).abs().max().item()
            seconds = _time(partial(plain, padded, image_sizes=image_sizes), partial(ours, images), reps)
        rows.append(_row("pixtral", [[h // patch, w // patch] for h, w in sizes], seconds, diff))
    return rows


def _row(family: str, grids: list[list[int]], seconds: dict, diff: float) -> dict:
    """`grids`: each image's patch rows and columns."""
    row = {
        "family": family, "image_patches": grids[0], "images": len(grids), "grids": grids, "seconds": seconds,
        "engine_vs_transformers": seconds["transformers"] / seconds["engine"], "max_abs_diff": diff,
    }  # fmt: skip
    shape = f"{grids[0][0]}x{grids[0][1]}" if all(g == grids[0] for g in grids) else "mixed"
    print(
        f"{family:11s} {shape:>5s} patches x{len(grids):<3d} transformers {seconds['transformers']:7.3f} s"
        f"  engine {seconds['engine']:7.3f} s  x{row['engine_vs_transformers']:.2f}  diff {diff:.1e}",
        flush=True,
    )
    return row


def run(dtype: torch.dtype, reps: int, platform, families: list[str]) -> list[dict]:
    rows = []
    for family in families:
        if family in VIT_FAMILIES:
            rows += run_vit(family, dtype, reps, platform)
            continue
        if family == "pixtral":
            rows += run_pixtral(dtype, reps, platform)
            continue
        config, plain, ours = qwen_towers(family, dtype, platform)
        per_patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        for h, w, n in CASES:
            grids = [(1, h, w)] * n
            pixels = torch.randn(n * h * w, per_patch).to(dtype)
            grid = torch.tensor(grids)
            with torch.inference_mode():
                want = plain(pixels, grid_thw=grid).pooler_output
                diff = (ours(pixels, grids).pooler_output - want).abs().max().item()
                seconds = _time(partial(plain, pixels, grid_thw=grid), partial(ours, pixels, grids), reps)
            rows.append(_row(family, [[h, w]] * n, seconds, diff))
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--reps", type=int, default=2)
    names = [*FAMILIES, *VIT_FAMILIES, "pixtral"]
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
