"""Deterministic random test images."""

from __future__ import annotations

import torch
from PIL import Image


def make_image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")
