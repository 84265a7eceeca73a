"""Stage one of bench.train_demo: the vision tower learns, on its own dense targets, what the
language model will need to read off its patch tokens.

Every patch token predicts the colour, kind (and the two as one class) and left-to-right rank of
the shape under it, and how many shapes the image holds, each shape weighted alike however many
patches it covers. The heads are thrown away after training.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from transformers import LlavaForConditionalGeneration

from mm_engine.demo import scenes
from mm_engine.vision.preprocess import ImagePreprocessor

IMAGE_SIZE, PATCH = 96, 12  # 8 x 8 = 64 image tokens
GRID = IMAGE_SIZE // PATCH
N_IMAGE_TOKENS = GRID * GRID

# The engine's own copy of the SigLIP preprocessing, so training sees the pixels inference sees.
PREPROCESS = ImagePreprocessor(size=(IMAGE_SIZE, IMAGE_SIZE))


# Per-patch targets of the tower: (name, classes); class 0 is "background" for all but count.
HEADS = (("colour", 5), ("kind", 4), ("pair", 13), ("rank", 4), ("count", 3))


def patch_labels(scene: scenes.Scene) -> np.ndarray:
    """[N_IMAGE_TOKENS, len(HEADS)] class ids per patch. "pair" is colour and kind as one class,
    so a question like "Is there a red circle?" can match one feature; "count" is the same in
    every patch. A patch belongs to the shape covering most of it, if that covers 1/8 of it."""
    mask = Image.new("L", scene.size, 0)
    draw = ImageDraw.Draw(mask)
    for i, shape in enumerate(scene.shapes):
        scenes.draw_shape(draw, shape, i + 1)
    m = np.asarray(mask.resize((IMAGE_SIZE, IMAGE_SIZE), Image.NEAREST))
    m = m.reshape(GRID, PATCH, GRID, PATCH).transpose(0, 2, 1, 3).reshape(N_IMAGE_TOKENS, PATCH * PATCH)
    cover = np.stack([(m == i + 1).sum(1) for i in range(len(scene.shapes))], 1)
    rank = np.where(cover.max(1) * 8 >= PATCH * PATCH, cover.argmax(1) + 1, 0)
    colour = [0] + [list(scenes.COLOURS).index(s.colour) + 1 for s in scene.shapes]
    kind = [0] + [scenes.SHAPES.index(s.kind) + 1 for s in scene.shapes]
    pair = [0] + [(c - 1) * 3 + k for c, k in zip(colour[1:], kind[1:], strict=True)]
    count = np.full_like(rank, len(scene.shapes) - 1)
    return np.stack([np.take(colour, rank), np.take(kind, rank), np.take(pair, rank), rank, count], 1)


def scene_batch(rng: random.Random, n: int) -> tuple[list[scenes.Scene], torch.Tensor]:
    batch = [scenes.random_scene(rng) for _ in range(n)]
    return batch, PREPROCESS.batch([s.image for s in batch])


def tower_features(model: LlavaForConditionalGeneration, pixels: torch.Tensor) -> torch.Tensor:
    """What LLaVA feeds the projector: the last encoder layer's output (before the post-norm)."""
    return model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1]


def lr_at(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    return peak * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def tower_loss(heads: torch.nn.Linear, feats: torch.Tensor, scene_list: list[scenes.Scene]):
    """Sum of the heads' cross-entropies, and each head's accuracy on shape patches.

    Every shape, and the background, of an image gets the same total weight: unweighted, big
    shapes own most patches and the small ones, the hard ones, are drowned out."""
    labels = torch.from_numpy(np.stack([patch_labels(s) for s in scene_list])).long()
    rank = labels[..., 3]
    onehot = F.one_hot(rank, 4).float()
    weights = (onehot / onehot.sum(1, keepdim=True).clamp(min=1)).sum(-1)
    logits = heads(feats).split([n for _, n in HEADS], dim=-1)
    loss, accs = 0.0, {}
    for i, ((name, _), lg) in enumerate(zip(HEADS, logits, strict=True)):
        ce = F.cross_entropy(lg.transpose(1, 2), labels[..., i], reduction="none")
        loss = loss + (ce.mean() if name == "count" else (ce * weights).sum() / weights.sum())
        accs[name] = (lg.argmax(-1) == labels[..., i])[rank > 0].float().mean().item()
    return loss, accs


def train_tower(model, heads: torch.nn.Linear, rng: random.Random, steps: int, batch: int, lr: float) -> None:
    params = [*model.model.vision_tower.parameters(), *heads.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    start = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        batch_scenes, pixels = scene_batch(rng, batch)
        loss, accs = tower_loss(heads, tower_features(model, pixels), batch_scenes)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            shown = " ".join(f"{k} {v:.3f}" for k, v in accs.items())
            print(
                f"tower {step:5d} loss {loss.item():.3f} right on shapes: {shown} [{elapsed(start)}]",
                flush=True,
            )


def elapsed(start: float) -> str:
    return f"{time.perf_counter() - start:.0f}s"
