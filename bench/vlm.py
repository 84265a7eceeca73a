"""The benchmark model and workloads shared by bench.offline, bench.serve, bench.memory and
bench.roofline.

The model is a random-weight LLaVA checkpoint at the size of a real small VLM: a SigLIP-base-like
tower (12 layers, hidden 768, patch 16 at 224 px: 196 image tokens) and a SmolLM2-135M-like
language model (30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied head). It is
made once into a cache folder (`MM_ENGINE_BENCH_CACHE`, default ~/.cache/mm-engine/bench); nothing
is downloaded. Random weights generate arbitrary tokens, so every request sets its own output
length (`max_tokens` with `ignore_eos`), drawn from a seeded long-tailed distribution.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mm_engine.demo import scenes
from mm_engine.testing import build_checkpoint

NAME = "smolvlm-like-v2"  # bump when the dimensions change, so an old cache is not reused
IMAGE_SIZE, PATCH = 224, 16
# No attention-pooling head: LLaVA reads the patch tokens only (real LLaVA SigLIP towers drop it too).
VISION_DIMS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    vision_use_head=False,
)
TEXT_DIMS = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
VOCAB = 49152
EVEN_HEADS = dict(num_attention_heads=8, num_key_value_heads=4)  # head size 72

CAPTION_PROMPT = "USER: <image> describe this image ASSISTANT:"
CHAT_QUESTIONS = (
    "what is in this picture",
    "how many shapes are there",
    "describe the color of the left shape",
    "tell me about the shape on the right and where it is",
)
# Output lengths: log-normal, clipped. Caption: mean ~30, at most 64. Chat: mean ~100, at most 384.
LENGTHS = {"caption": (3.22, 0.6, 4, 64), "chat": (4.29, 0.8, 8, 384)}


def cache_dir() -> Path:
    return Path(os.environ.get("MM_ENGINE_BENCH_CACHE", Path.home() / ".cache" / "mm-engine" / "bench"))


def bench_model_path(byte_level: bool = False, even_heads: bool = False) -> Path:
    """The benchmark checkpoint, built on first use (about a minute; 0.9 GB in float32).
    `byte_level`: the same model with a byte-level BPE tokenizer, which can spell JSON
    (structured output; the word-level one cannot). `even_heads`: 8 query and 4 KV heads of 72
    instead of 9 and 3 of 64, so that tensor parallelism can split it in 2 or 4."""
    name = NAME + ("-bytelevel" if byte_level else "") + ("-even-heads" if even_heads else "")
    return built_once(name, "the benchmark model", lambda out: build_checkpoint(
        "llava", out, vision="siglip", text="llama", image_size=IMAGE_SIZE, patch_size=PATCH,
        select_strategy="full", feature_layer=-1, vision_dims=VISION_DIMS,
        text_dims={**TEXT_DIMS, **EVEN_HEADS} if even_heads else TEXT_DIMS, vocab_size=VOCAB,
        # Wider than the default init so greedy picks have clear margins: ties would make the
        # engine-vs-transformers token check flaky on float rounding alone.
        weight_scale=2.0, byte_level=byte_level,
    ))  # fmt: skip


def built_once(name: str, what: str, build) -> Path:
    """The cached checkpoint `name`, built by `build(folder)` the first time (into a temporary
    folder moved into place, so that an interrupted build leaves nothing half-written)."""
    path = cache_dir() / name
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {what} into {path} (once) ...", flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        shutil.move(str(build(Path(tmp) / name)), path)
    return path


# The Qwen2.5-VL benchmark model: a tower of SigLIP-base's size with Qwen2.5's window attention
# (patch 14, 2x2 merge, windows of 112 px, full attention every 4th layer) before the same
# SmolLM2-135M-like language model (M-RoPE sections for its head size 64). min_pixels makes the
# benchmark scenes (224 px and up) at least 392 x 392: 196 tokens an image, as the LLaVA model.
QWEN_NAME = "qwen2.5-vl-like-v2"  # v2: its chat template and video processor take clips
QWEN_VISION_DIMS = dict(
    depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=576, window_size=112,
    fullatt_block_indexes=[3, 7, 11], hidden_act="silu",
)  # fmt: skip
QWEN_TEXT_DIMS = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=4096,
)  # fmt: skip
# The Qwen3.5 benchmark model: Qwen3.5-0.8B's language model (hidden 1024, 24 layers, three Gated
# DeltaNet layers to one gated full-attention layer, 8 query / 2 KV heads of 256, 16 linear key
# and value heads of 128, MLP 3584) with the benchmark vocabulary, after a Qwen3.5 tower of
# SigLIP-base's size (patch 16, 2x2 merge). Same pixel bounds: 196 tokens an image.
QWEN35_NAME = "qwen3.5-0.8b-like-v1"
QWEN35_VISION_DIMS = dict(
    depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
    num_position_embeddings=2304,
)  # fmt: skip
QWEN35_TEXT_DIMS = dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=4096,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, partial_rotary_factor=0.25,
)  # fmt: skip
# The OCR benchmark model: LightOnOCR-1B's widths (a 1024-wide Pixtral tower of 14-pixel patches,
# pages up to 1540 px; a Qwen3 language model, hidden 1024, 16 / 8 heads of 128, MLP 3072) at half
# its depths (12 tower and 14 language-model layers, so that a 2-core run takes minutes), with the
# benchmark vocabulary. A 1240 x 1754 page is 1092 x 1540 pixels: 2,145 image tokens.
OCR_NAME = "lighton-ocr-like-v1"
OCR_VISION_DIMS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                       head_dim=64)  # fmt: skip
OCR_TEXT_DIMS = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=14, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
)  # fmt: skip
# The GLM-OCR benchmark model: GLM-OCR's widths (a 1024-wide GLM-OCR tower of 14-pixel patches; a
# GLM language model, hidden 1536, 16 / 8 heads of 128 with the rotary over half, MLP 4608) at
# half its depths (12 tower and 8 language-model layers), with the benchmark vocabulary, and GLM's
# default pixel bounds: a 1240 x 1754 page is 1232 x 1764 pixels, 2,772 image tokens.
GLM_OCR_NAME = "glm-ocr-like-v1"
GLM_OCR_VISION_DIMS = dict(depth=12, hidden_size=1024, intermediate_size=4096, num_heads=16)
GLM_OCR_TEXT_DIMS = dict(
    hidden_size=1536, intermediate_size=4608, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=16384,
)  # fmt: skip
# The PaddleOCR-VL benchmark model: PaddleOCR-VL-0.9B's widths (a 1152-wide NaViT SigLIP of 14-pixel
# patches; ERNIE-4.5, hidden 1024, 16 / 2 heads of 128, MLP 3072) at half its depths (14 tower and 9
# language-model layers), the benchmark vocabulary, the processor's default bounds (384^2 to 1536^2
# pixels): a 1240 x 1754 page is 1232 x 1764 pixels, 2,772 image tokens.
PADDLE_NAME = "paddleocr-vl-like-v1"
PADDLE_VISION_DIMS = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=14, num_attention_heads=16, image_size=384
)
PADDLE_TEXT_DIMS = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=9, num_attention_heads=16,
    num_key_value_heads=2, head_dim=128, max_position_embeddings=16384,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [16, 24, 24]},
)  # fmt: skip
# The SmolVLM2 benchmark model (video): SmolVLM2-500M-Video's widths (a 768-wide SigLIP of 16-pixel
# patches on 512-pixel frames, pixel shuffle 4: 64 tokens a frame; SmolLM2-360M, hidden 960, 15 / 5
# heads of 64, MLP 2560) at half its depths (6 tower and 16 language-model layers), byte-level BPE.
SMOLVLM2_NAME = "smolvlm2-like-v1"
SMOLVLM2_VISION_DIMS = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=12, image_size=512,
    patch_size=16,
)  # fmt: skip
SMOLVLM2_TEXT_DIMS = dict(
    hidden_size=960, intermediate_size=2560, num_hidden_layers=16, num_attention_heads=15,
    num_key_value_heads=5, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
)  # fmt: skip
PAGE_SIZE = (1240, 1754)  # A4 at 150 dpi
MODEL_ALIASES = ("bench", "bench-bytelevel", "bench-even-heads", "bench-qwen2.5-vl", "bench-qwen3.5",
                 "bench-lighton-ocr", "bench-glm-ocr", "bench-paddleocr", "bench-smolvlm2")  # fmt: skip


def resolve_model(model: str | None) -> str:
    """A checkpoint folder as it is; `bench` (the default), `bench-qwen2.5-vl` or `bench-qwen3.5`:
    built once."""
    if model in (None, "bench"):
        return str(bench_model_path())
    if model == "bench-bytelevel":
        return str(bench_model_path(byte_level=True))
    if model == "bench-even-heads":
        return str(bench_model_path(even_heads=True))
    if model == "bench-qwen2.5-vl":
        return str(bench_qwen_model_path())
    if model == "bench-qwen3.5":
        return str(bench_qwen_model_path("qwen3_5"))
    if model == "bench-lighton-ocr":
        return str(bench_ocr_model_path())
    if model == "bench-glm-ocr":
        return str(bench_glm_ocr_model_path())
    if model == "bench-paddleocr":
        return str(bench_paddle_model_path())
    if model == "bench-smolvlm2":
        return str(bench_smolvlm2_model_path())
    return model


def bench_smolvlm2_model_path() -> Path:
    """The SmolVLM2-shaped benchmark model (a frame is one 512-pixel tile); built once."""
    return built_once(SMOLVLM2_NAME, "the SmolVLM2 benchmark model", lambda out: build_checkpoint(
        "smolvlm", out, tile=512, longest_edge=512, scale_factor=4, text_dims=SMOLVLM2_TEXT_DIMS,
        vision_dims=SMOLVLM2_VISION_DIMS, vocab_size=VOCAB, weight_scale=2.0, byte_level=True,
    ))  # fmt: skip


def bench_glm_ocr_model_path() -> Path:
    """The GLM-OCR-shaped benchmark model; built once."""
    return built_once(GLM_OCR_NAME, "the GLM-OCR benchmark model", lambda out: build_checkpoint(
        "glm_ocr", out, patch_size=14, min_pixels=112 * 112, max_pixels=28 * 28 * 15000,
        text_dims=GLM_OCR_TEXT_DIMS, vision_dims=GLM_OCR_VISION_DIMS, vocab_size=VOCAB, weight_scale=2.0,
    ))  # fmt: skip


def bench_paddle_model_path() -> Path:
    """The PaddleOCR-VL-shaped benchmark model; built once."""
    return built_once(PADDLE_NAME, "the PaddleOCR-VL benchmark model", lambda out: build_checkpoint(
        "paddleocr_vl", out, patch_size=14, min_pixels=384 * 384, max_pixels=1536 * 1536,
        text_dims=PADDLE_TEXT_DIMS, vision_dims=PADDLE_VISION_DIMS, vocab_size=VOCAB, weight_scale=2.0,
    ))  # fmt: skip


def bench_ocr_model_path() -> Path:
    """The OCR benchmark model (LightOnOCR-shaped); built once."""
    return built_once(OCR_NAME, "the OCR benchmark model", lambda out: build_checkpoint(
        "lighton_ocr", out, patch_size=14, longest_edge=1540, text_dims=OCR_TEXT_DIMS,
        vision_dims=OCR_VISION_DIMS, vocab_size=VOCAB, weight_scale=2.0,
    ))  # fmt: skip


def bench_qwen_model_path(version: str = "qwen2_5_vl") -> Path:
    """The Qwen2.5-VL benchmark model, or (`version="qwen3_5"`) the Qwen3.5 one; built once."""
    if version == "qwen3_5":
        name, patch, text, vision = QWEN35_NAME, 16, QWEN35_TEXT_DIMS, QWEN35_VISION_DIMS
    else:
        name, patch, text, vision = QWEN_NAME, 14, QWEN_TEXT_DIMS, QWEN_VISION_DIMS
    return built_once(name, f"the {version} benchmark model", lambda out: build_checkpoint(
        version, out, patch_size=patch, min_pixels=(28 * patch) ** 2, max_pixels=1024 * (2 * patch) ** 2,
        text_dims=text, vision_dims=vision, vocab_size=VOCAB, weight_scale=2.0,
    ))  # fmt: skip


# The host floor of a decode step: a twin of a Qwen benchmark model with the same layers (count,
# kinds, order), vocabulary and template, but widths of 64, so that its step reads hardly any bytes
# and costs what the host does around the kernels (Python, torch ops, each kernel's call).
FLOOR_TEXT_DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
FLOOR_HYBRID_DIMS = dict(
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=32,
)  # fmt: skip


def floor_model_path(model: str) -> Path | None:
    """The host-floor twin of `bench-qwen2.5-vl` or `bench-qwen3.5` (built once); None for others."""
    if model not in ("bench-qwen2.5-vl", "bench-qwen3.5"):
        return None
    version = "qwen3_5" if model == "bench-qwen3.5" else "qwen2_5_vl"
    text = (
        dict(QWEN35_TEXT_DIMS, **FLOOR_TEXT_DIMS, **FLOOR_HYBRID_DIMS)
        if version == "qwen3_5"
        else dict(QWEN_TEXT_DIMS, **FLOOR_TEXT_DIMS)
    )
    name = (QWEN35_NAME if version == "qwen3_5" else QWEN_NAME) + "-floor"
    return built_once(name, f"the {version} host-floor twin", lambda out: build_checkpoint(
        version, out, text_dims=text, vocab_size=VOCAB, weight_scale=2.0,
    ))  # fmt: skip


def prompts_for(model: str):
    """(caption prompt, question -> chat prompt) for a checkpoint: LLaVA's fixed strings for the
    LLaVA model (its figures stay comparable across versions), the checkpoint's own chat template
    for any other family."""
    from transformers import AutoConfig, AutoProcessor

    if AutoConfig.from_pretrained(model).model_type == "llava":
        return CAPTION_PROMPT, chat_prompt
    processor = AutoProcessor.from_pretrained(model)

    def ask(question: str) -> str:
        content = [{"type": "image"}, {"type": "text", "text": question}]
        return processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    return ask("describe this image"), ask


def video_prompt_for(model: str) -> str:
    """The captioning prompt of a clip, through the checkpoint's chat template."""
    from transformers import AutoProcessor

    content = [{"type": "video"}, {"type": "text", "text": "describe this video"}]
    return AutoProcessor.from_pretrained(model).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


CLIP_FRAMES, CLIP_FPS = 8, 2.0  # a 4-second clip as Qwen's tooling samples it


def clips(n: int, seed: int) -> list[tuple[torch.Tensor, float]]:
    """Clips of generated scenes: each a scene panning sideways over `CLIP_FRAMES` frames, as
    `([T, H, W, 3] uint8, fps)` (sampled frames, as a decoder hands them over)."""
    out = []
    for image in images(n, seed):
        rgb = np.asarray(image.convert("RGB"))
        frames = [np.roll(rgb, 8 * k, axis=1) for k in range(CLIP_FRAMES)]
        out.append((torch.from_numpy(np.stack(frames)), CLIP_FPS))
    return out


def output_lengths(n: int, workload: str, seed: int) -> list[int]:
    mu, sigma, lo, hi = LENGTHS[workload]
    rng = random.Random(f"lengths-{workload}-{seed}")
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def images(n: int, seed: int) -> list[Image.Image]:
    """Generated scenes at varied sizes and aspect ratios (the preprocessing resizes them)."""
    rng = random.Random(f"bench-images-{seed}")
    return [scenes.random_scene(rng).image for _ in range(n)]


def pages(n: int, seed: int) -> list[Image.Image]:
    """Document-sized pages (`PAGE_SIZE`): white, a generated scene as a figure, rows of dark bars
    for the lines of text around it."""
    rng = random.Random(f"bench-pages-{seed}")
    out = []
    for _ in range(n):
        page = np.full((PAGE_SIZE[1], PAGE_SIZE[0], 3), 250, dtype=np.uint8)
        for top in range(120, PAGE_SIZE[1] - 120, 36):
            left, right = 110, PAGE_SIZE[0] - 110 - rng.randrange(0, 400)
            while left < right:
                word = rng.randrange(30, 140)
                page[top : top + 18, left : min(left + word, right)] = rng.randrange(0, 60)
                left += word + 14
        figure = np.asarray(scenes.random_scene(rng).image.convert("RGB").resize((600, 420)))
        page[600:1020, 320:920] = figure
        out.append(Image.fromarray(page))
    return out


def noise_image(seed: int, size: tuple[int, int] = (320, 240)) -> Image.Image:
    px = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(px)


def chat_prompt(question: str) -> str:
    return f"USER: <image> {question} ASSISTANT:"
