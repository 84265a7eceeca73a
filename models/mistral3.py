"""Mistral 3 with its Pixtral tower (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2).

The processor resizes an image so its longest edge is at most `size.longest_edge` and both sides
are multiples of patch x merge size; there is no fixed resolution. The Pixtral tower runs every
image's patches as one sequence with 2-D rotary positions (row, column) and attention kept inside
each image; the projector norms, merges each 2x2 patches into one token and projects. The
prompt's `[IMG]` becomes, per row of merged patches, `[IMG]` x columns then `[IMG_BREAK]`, the last
break replaced by `[IMG_END]`; only the `[IMG]` positions carry embeddings. The language model is
Mistral's, with 1-D positions.

The tower is the engine's Pixtral (layers/pixtral_tower.py), the projector transformers' module;
the language model runs on the engine's paged layers.
Weights: `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*` (or the older `vision_tower.*`, `language_model.model.*` layout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.kernels.host_copy import to_device
from mm_engine.models.interface import ProcessedImage, Processing
from mm_engine.models.layers.pixtral_tower import PixtralTower, pixtral_state
from mm_engine.models.llava import feature_layers
from mm_engine.models.options import longest_edge
from mm_engine.models.platform import Platform
from mm_engine.models.tower_projector import TowerProjectorModel
from mm_engine.models.weights import load_strict
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash

SUPPORTED_TEXT = ("mistral", "llama")


def check_config(config, supported: tuple[str, ...] = SUPPORTED_TEXT) -> None:
    if config.text_config.model_type not in supported:
        raise ValueError(
            f"unsupported language model {config.text_config.model_type!r}; supported: {supported}"
        )
    if getattr(config.text_config, "sliding_window", None):
        raise ValueError("sliding-window attention in the language model is not supported")


class PixtralProcessing(Processing):
    """The checkpoint's own Pixtral image processor (transformers'), one image per call."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(path)
        self.hf = hf.image_processor
        self.step = hf.patch_size * hf.spatial_merge_size  # pixels per merged token, each way
        self.image_token = hf.image_token
        self.image_token_id = hf.image_token_id
        self.break_id, self.end_id = hf.image_break_token_id, hf.image_end_token_id
        self.edge = longest_edge(self.hf.size.longest_edge, kwargs)
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str)

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        edge = longest_edge(self.edge, overrides)
        out = self.hf(images=[image], size={"longest_edge": edge}, patch_size=self.step, return_tensors="pt")
        height, width = (int(v) for v in out["image_sizes"][0])
        rows, cols = height // self.step, width // self.step
        tokens = ([self.image_token_id] * cols + [self.break_id]) * rows
        tokens[-1] = self.end_id
        mask = tuple(t == self.image_token_id for t in tokens)
        pixels = out["pixel_values"][0][:, :height, :width]  # one image: nothing to pad
        digest = image_content_hash(image, f"{self._salt}|{edge}".encode())
        return ProcessedImage(pixels, tokens, mask, rows * cols, digest, grid=(height, width))


class Mistral3Model(TowerProjectorModel):
    family = "Mistral 3"

    @staticmethod
    def projector_class():
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        return Mistral3MultiModalProjector

    @classmethod
    def build_tower(cls, state: dict, config, platform: Platform) -> PixtralTower:
        layers = feature_layers(config)
        tower = PixtralTower(config.vision_config, layers, platform.ops)
        load_strict(tower, pixtral_state(state, max(layers)), "vision tower")
        tower.fuse()
        return tower

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        lm_weight = self.language_model.embed_tokens.weight
        pixels = [span.pixel_values.to(lm_weight.device, self.vision_dtype) for span in images]
        feats = torch.cat(self.vision_tower(pixels), dim=-1)
        sizes = to_device([span.grid for span in images], None, lm_weight.device)
        feats = self.multi_modal_projector(feats.to(lm_weight.dtype), sizes)
        return list(feats.reshape(-1, 1, feats.shape[-1]).split([span.num_embeds for span in images]))
