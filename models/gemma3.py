"""Gemma 3 (`Gemma3ForConditionalGeneration`).

The processor resizes an image to the SigLIP tower's square resolution; the projector averages the
patch grid down to `mm_tokens_per_image` tokens, RMS-norms them and projects them. The prompt's
`<start_of_image>` becomes `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
`<end_of_image>\\n\\n`; the soft tokens carry the embeddings and, during prefill, attend to each
other in both directions (`bidirectional_images`): the runner hands each token its image's range,
and the scheduler never splits an image across prefill chunks, since every key of an image must
be written before any of its queries runs. The language model (gemma_layers.py) alternates
sliding-window and global layers.

Tower and projector are transformers' modules; the language model runs on the engine's paged
layers. Weights: `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*` (tied in the published checkpoints).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.gemma_layers import GemmaLM
from mm_engine.models.interface import MultimodalModel, ProcessedImage, Processing
from mm_engine.models.weights import (
    default_dtype,
    load_strict,
    load_tower_and_projector,
    read_weights,
    ready,
    route_tower_projector_lm,
    split_by_prefix,
)
from mm_engine.platform import Platform
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash


def check_config(config) -> None:
    if config.text_config.model_type != "gemma3_text":
        raise ValueError(f"unsupported language model {config.text_config.model_type!r} for Gemma 3")


class Gemma3Processing(Processing):
    """The checkpoint's own image processor (transformers'), one image per call."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        if kwargs:
            raise ValueError(f"mm_processor_kwargs are not supported for Gemma 3: {', '.join(kwargs)}")
        hf = AutoProcessor.from_pretrained(path)
        self.hf = hf.image_processor
        if getattr(self.hf, "do_pan_and_scan", False):
            raise ValueError("Gemma 3 pan-and-scan crops (do_pan_and_scan) are not supported yet")
        self.image_token = hf.boi_token
        self.image_token_id = hf.image_token_id  # the boi token: the prompt's placeholder
        soft = config.image_token_id
        n = config.mm_tokens_per_image
        newlines = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        self.run = [*newlines, tokenizer.convert_tokens_to_ids(hf.boi_token), *[soft] * n]
        self.run += [tokenizer.convert_tokens_to_ids(tokenizer.eoi_token), *newlines]
        self.mask = tuple(t == soft for t in self.run)
        self.num = n
        self.fixed_tokens = len(self.run)
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str).encode()

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        if overrides:
            raise ValueError(f"mm_processor_kwargs are not supported for Gemma 3: {', '.join(overrides)}")
        pixels = self.hf(images=[image], return_tensors="pt")["pixel_values"][0]
        return ProcessedImage(
            pixels, list(self.run), self.mask, self.num, image_content_hash(image, self._salt)
        )


class Gemma3Model(MultimodalModel):
    bidirectional_images = True

    def __init__(self, config, vision_tower: torch.nn.Module, projector: torch.nn.Module, language_model):
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.language_model = language_model
        self.image_token_id = config.image_token_id

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(self.vision_tower.parameters()).dtype

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        lm_weight = self.language_model.embed_tokens.weight
        pixels = torch.stack([span.pixel_values for span in images]).to(lm_weight.device, self.vision_dtype)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        feats = self.multi_modal_projector(hidden.to(lm_weight.dtype))  # [images, tokens, hidden]
        return list(feats[:, :, None])

    @classmethod
    def from_checkpoint(
        cls, path: Path, config, dtype: torch.dtype, vision_dtype: torch.dtype, device: torch.device,
        platform: Platform, pack_weights: bool,
    ) -> MultimodalModel:  # fmt: skip
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        parts = split_by_prefix(read_weights(path), route_tower_projector_lm, "Gemma 3")
        lm_state = parts.get("lm", {})
        with torch.device(device), default_dtype(dtype):
            lm = GemmaLM(config.text_config, "lm_head.weight" not in lm_state, platform.ops)
        load_strict(lm, lm_state, "language model")
        lm.fuse_projections()
        tower, projector = load_tower_and_projector(
            parts, config, Gemma3MultiModalProjector, dtype, vision_dtype, device
        )
        model = cls(config, tower, projector, lm)
        return ready(model, model.vision_tower, platform, pack_weights)
