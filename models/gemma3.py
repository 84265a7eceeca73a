"""Gemma 3 (`Gemma3ForConditionalGeneration`).

The processor resizes an image to the SigLIP tower's square resolution; the projector averages the
patch grid down to `mm_tokens_per_image` tokens, RMS-norms them and projects them. The prompt's
`<start_of_image>` becomes `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
`<end_of_image>\\n\\n` (with pan-and-scan, one such run per crop after the original's); the soft
tokens carry the embeddings and, during prefill, each run's attend to each other in both
directions (`bidirectional_images`): the runner hands each token its run's range, and the
scheduler never splits an image across prefill chunks, since every key of a run must be written
before any of its queries runs. The language model (gemma_layers.py) alternates
sliding-window and global layers.

The tower is the engine's SigLIP (layers/vit_tower.py, its final norm included), the projector
transformers' module; the language model runs on the engine's paged layers.
Weights: `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*` (tied in the published checkpoints).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.models.interface import ProcessedImage, Processing
from mm_engine.models.layers.gemma import GemmaLM
from mm_engine.models.layers.vit_tower import VitTower, own_tower_kind, tower_state
from mm_engine.models.platform import Platform
from mm_engine.models.tower_projector import TowerProjectorModel
from mm_engine.models.weights import (
    load_strict,
)
from mm_engine.parallel.group import check_divisible
from mm_engine.parallel.shard import shard_state
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash


def check_config(config) -> None:
    if config.text_config.model_type != "gemma3_text":
        raise ValueError(f"unsupported language model {config.text_config.model_type!r} for Gemma 3")


# mm_processor_kwargs: the processor's pan-and-scan settings (vLLM passes the same names).
PAN_AND_SCAN = {
    "do_pan_and_scan": bool,
    "pan_and_scan_min_crop_size": int,
    "pan_and_scan_max_num_crops": int,
    "pan_and_scan_min_ratio_to_activate": float,
}


class Gemma3Processing(Processing):
    """The checkpoint's own image processor (transformers'), one image per call. With pan-and-scan
    (the processor config's `do_pan_and_scan`, or `mm_processor_kwargs`) a wide or tall image also
    gets crops, each its own `<start_of_image>` run after the original's, in transformers' words."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(path)
        self.hf, self.tokenizer = hf.image_processor, tokenizer
        self.image_token = hf.boi_token
        self.image_token_id = hf.image_token_id  # the boi token: the prompt's placeholder
        self.soft, self.num = config.image_token_id, config.mm_tokens_per_image
        self.full = hf.full_image_sequence
        self._runs: dict[int, tuple[list[int], tuple[bool, ...]]] = {}
        # The processor's own defaults for what preprocessor_config.json leaves null, then the
        # image processor's settings, then the server's options.
        defaults = {k: v for k, v in getattr(type(hf), "images_kwargs", {}).items() if k in PAN_AND_SCAN}
        saved = {k: getattr(self.hf, k) for k in PAN_AND_SCAN if getattr(self.hf, k, None) is not None}
        self.options = self._options({**defaults, **saved}, kwargs)
        if not self.options.get("do_pan_and_scan"):
            self.fixed_tokens = len(self._run(0)[0])
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str)

    @staticmethod
    def _options(base: dict, options: Mapping[str, Any] | None) -> dict:
        out = dict(base)
        for key, value in (options or {}).items():
            kind = PAN_AND_SCAN.get(key)
            if kind is None:
                known = ", ".join(PAN_AND_SCAN)
                raise ValueError(f"unknown mm_processor_kwargs option {key!r}; supported: {known}")
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"mm_processor_kwargs {key} must be true or false, got {value!r}")
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if kind is not bool and not (number and value > 0):
                raise ValueError(f"mm_processor_kwargs {key} must be a positive number, got {value!r}")
            out[key] = value
        return out

    def _run(self, crops: int) -> tuple[list[int], tuple[bool, ...]]:
        """Token ids of an image with `crops` pan-and-scan crops, and which are soft tokens."""
        if crops not in self._runs:
            text = self.full
            if crops:
                text = "Here is the original image " + self.full + " and here are some crops to help you "
                text += "see better " + " ".join([self.full] * crops)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._runs[crops] = ids, tuple(t == self.soft for t in ids)
        return self._runs[crops]

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        options = self._options(self.options, overrides)
        out = self.hf(images=[image], return_tensors="pt", **options)
        pixels = out["pixel_values"]  # the image, then its crops
        crops = int(out["num_crops"][0]) if "num_crops" in out else 0
        ids, mask = self._run(crops)
        salt = f"{self._salt}|{json.dumps(options, sort_keys=True)}".encode()
        digest = image_content_hash(image, salt)
        return ProcessedImage(pixels, list(ids), mask, self.num * (1 + crops), digest)


class Gemma3Model(TowerProjectorModel):
    bidirectional_images = True
    family = "Gemma 3"

    @staticmethod
    def projector_class():
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        return Gemma3MultiModalProjector

    @classmethod
    def build_tower(cls, state: dict, config, platform: Platform) -> VitTower:
        vc = config.vision_config
        if own_tower_kind(vc) != "siglip":
            raise ValueError(f"unsupported vision tower {vc.model_type!r} for Gemma 3")
        depth = vc.num_hidden_layers
        tower = VitTower(vc, [depth], platform.ops, post_norm=True)
        load_strict(tower, tower_state(state, depth, "siglip", post_norm=True), "vision tower")
        return tower

    @classmethod
    def build_language_model(cls, lm_state: dict, config, dtype, device, platform: Platform, tp=None):
        if tp is not None:
            check_divisible(config.text_config, tp.world)
        with torch.device(device):
            lm = GemmaLM(config.text_config, "lm_head.weight" not in lm_state, platform.ops, tp, dtype)
        load_strict(lm, lm_state if tp is None else shard_state(lm_state, lm, tp), "language model")
        lm.fuse_projections()
        return lm

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        lm_weight = self.language_model.embed_tokens.weight
        pixels = torch.cat([span.pixel_values for span in images]).to(lm_weight.device, self.vision_dtype)
        (hidden,) = self.vision_tower(pixels)
        feats = self.multi_modal_projector(hidden.to(lm_weight.dtype))  # [frames, tokens, hidden]
        feats = feats.reshape(-1, 1, feats.shape[-1])  # an image's frames: itself, then any crops
        return list(feats.split([span.num_embeds for span in images]))
