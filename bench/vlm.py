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
from PIL import Image

from mm_engine import scenes
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


def bench_model_path() -> Path:
    """The benchmark checkpoint, built on first use (about a minute; 0.9 GB in float32)."""
    path = cache_dir() / NAME
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the benchmark model into {path} (once) ...", flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = build_checkpoint(
            Path(tmp) / NAME,
            vision="siglip",
            text="llama",
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            select_strategy="full",
            feature_layer=-1,
            vision_dims=VISION_DIMS,
            text_dims=TEXT_DIMS,
            vocab_size=VOCAB,
            # Wider than the default init so greedy picks have clear margins: ties would make the
            # engine-vs-transformers token check flaky on float rounding alone.
            weight_scale=2.0,
        )
        shutil.move(str(built), path)
    return path


def output_lengths(n: int, workload: str, seed: int) -> list[int]:
    mu, sigma, lo, hi = LENGTHS[workload]
    rng = random.Random(f"lengths-{workload}-{seed}")
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def images(n: int, seed: int) -> list[Image.Image]:
    """Generated scenes at varied sizes and aspect ratios (the preprocessing resizes them)."""
    rng = random.Random(f"bench-images-{seed}")
    return [scenes.random_scene(rng).image for _ in range(n)]


def noise_image(seed: int, size: tuple[int, int] = (320, 240)) -> Image.Image:
    px = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(px)


def chat_prompt(question: str) -> str:
    return f"USER: <image> {question} ASSISTANT:"
