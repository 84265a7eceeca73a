"""Gemma 4 (`Gemma4ForConditionalGeneration`: E2B, E4B, 31B and the 26B-A4B MoE).

The processor resizes an image, keeping its aspect ratio, to the largest size whose patches fit
`max_soft_tokens` x k^2 (k: the tower's pooling kernel) with both sides multiples of k patches;
the image becomes `<boi>` + one soft token per k x k patches + `<eoi>`, so the number of tokens
depends on the image (at most `max_soft_tokens`: 70, 140, 280, 560 or 1120, per server and per
request through `mm_processor_kwargs`). The tower (layers/gemma4_vision.py) pools the patches to
those tokens; `embed_vision` norms and projects them. The language model (layers/gemma4.py) has
per-layer embeddings, KV-sharing layers, wider global heads and, where the config says
`use_bidirectional_attention="vision"`, image tokens that see each other in its sliding layers
(`bidirectional_images`: the scheduler keeps an image in one prefill chunk).

Weights: `model.vision_tower.*`, `model.embed_vision.*`, `model.language_model.*`; the audio
tower and its embedder (E2B, E4B) are not loaded, and a prompt with audio or video is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.models.interface import ProcessedImage, Processing
from mm_engine.models.layers.gemma4 import Gemma4LM, kv_sources
from mm_engine.models.layers.gemma4_vision import Gemma4Embedder, Gemma4VisionTower
from mm_engine.models.layers.moe import checkpoint_layout
from mm_engine.models.platform import Platform
from mm_engine.models.tower_projector import TowerProjectorModel
from mm_engine.models.weights import load_strict
from mm_engine.parallel.group import check_divisible
from mm_engine.parallel.shard import shard_state
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the processor's allowed `max_soft_tokens`
PER_LAYER_ROOT = ("embed_tokens_per_layer.", "per_layer_model_projection.", "per_layer_projection_norm.")
PER_LAYER_GATE = ("per_layer_input_gate.", "per_layer_projection.", "post_per_layer_input_norm.")


def check_config(config) -> None:
    text = config.text_config
    if text.model_type != "gemma4_text":
        raise ValueError(f"unsupported language model {text.model_type!r} for Gemma 4")
    if config.vision_config is None:
        raise ValueError("a Gemma 4 checkpoint without a vision tower is not a vision-language model")
    kv_sources(text)  # KV-sharing layers must have a layer to read


def route(key: str) -> tuple[str, str] | None:
    k = key.removeprefix("model.")
    for prefix, part in (
        ("vision_tower.", "vision"), ("embed_vision.", "projector"), ("audio_tower.", "audio"),
        ("embed_audio.", "audio"), ("language_model.", "lm"),
    ):  # fmt: skip
        if k.startswith(prefix):
            return part, k.removeprefix(prefix)
    return ("lm", k) if k.startswith("lm_head.") else None


def lm_weights(state: dict, config) -> dict:
    """The checkpoint's language-model keys as Gemma4LM names them: the per-layer embedding's
    parts under `per_layer.`; a KV-sharing layer's k/v projections (which it never runs) dropped."""
    sources, out = kv_sources(config), {}
    for key, ref in state.items():
        if key.startswith(PER_LAYER_ROOT):
            key = "per_layer." + key
        parts = key.split(".")
        if parts[0] == "layers":
            i, rest = int(parts[1]), ".".join(parts[2:])
            if rest.startswith(PER_LAYER_GATE):
                key = f"layers.{i}.per_layer.{rest}"
            elif sources[i] != i and rest.startswith(("self_attn.k_", "self_attn.v_")):
                continue
        out[key] = ref
    return out


class Gemma4Processing(Processing):
    """The checkpoint's own image processor (transformers'), one image per call; its padding to
    `max_soft_tokens` x k^2 patches is dropped."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(path)
        self.hf, self.tokenizer = hf.image_processor, tokenizer
        self.image_token, self.image_token_id = hf.image_token, hf.image_token_id
        self.boi, self.eoi = tokenizer.convert_tokens_to_ids([hf.boi_token, hf.eoi_token])
        self.options = self._options({"max_soft_tokens": self.hf.max_soft_tokens}, kwargs)
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str)

    @staticmethod
    def _options(base: dict, options: Mapping[str, Any] | None) -> dict:
        out = dict(base)
        for key, value in (options or {}).items():
            if key != "max_soft_tokens":
                raise ValueError(f"unknown mm_processor_kwargs option {key!r}; supported: max_soft_tokens")
            if isinstance(value, bool) or value not in SOFT_TOKENS:
                raise ValueError(
                    f"mm_processor_kwargs max_soft_tokens must be one of {SOFT_TOKENS}, got {value!r}"
                )
            out[key] = value
        return out

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        options = self._options(self.options, overrides)
        out = self.hf(images=[image], return_tensors="pt", **options)
        n = int(out["num_soft_tokens_per_image"][0])
        patches = n * self.hf.pooling_kernel_size**2
        columns = int(out["image_position_ids"][0, :patches, 0].max()) + 1
        pixels = out["pixel_values"][0, :patches]
        tokens = [self.boi, *([self.image_token_id] * n), self.eoi]
        mask = (False, *([True] * n), False)
        salt = f"{self._salt}|{json.dumps(options, sort_keys=True)}".encode()
        grid = (patches // columns, columns)
        return ProcessedImage(pixels, tokens, mask, n, image_content_hash(image, salt), grid=grid)


def _embedder(config) -> Gemma4Embedder:
    vc = config.vision_config
    return Gemma4Embedder(vc.hidden_size, config.text_config.hidden_size, vc.rms_norm_eps)


class Gemma4Model(TowerProjectorModel):
    family = "Gemma 4"
    route = staticmethod(route)

    def __init__(self, config, vision_tower, projector, language_model) -> None:
        super().__init__(config, vision_tower, projector, language_model)
        self.bidirectional_images = config.text_config.use_bidirectional_attention == "vision"
        refused = {}
        for name, what in (("audio_token_id", "audio"), ("video_token_id", "video")):
            if getattr(config, name, None) is not None:
                refused[getattr(config, name)] = f"Gemma 4 {what} input is not supported yet"
        self.refused_tokens = refused

    @staticmethod
    def projector_class():
        return _embedder

    @classmethod
    def build_tower(cls, state: dict, config, platform: Platform) -> Gemma4VisionTower:
        tower = Gemma4VisionTower(config.vision_config, platform.ops)
        load_strict(tower, state, "vision tower")
        return tower

    @classmethod
    def build_language_model(cls, lm_state: dict, config, dtype, device, platform: Platform, tp=None):
        text = config.text_config
        if tp is not None:
            check_divisible(text, tp.world)
        state = lm_weights(lm_state, text)
        if getattr(text, "enable_moe_block", False):
            state = checkpoint_layout(state, text)  # experts as the engine keeps them, before any split
        with torch.device(device):
            placeholders = (config.image_token_id, config.video_token_id, config.audio_token_id)
            aliases = tuple(i for i in placeholders if i is not None)
            lm = Gemma4LM(text, "lm_head.weight" not in state, platform.ops, tp, dtype, aliases)
        load_strict(lm, state if tp is None else shard_state(state, lm, tp), "language model")
        return lm

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        lm_weight = self.language_model.embed_tokens.weight
        pixels = torch.cat([span.pixel_values for span in images]).to(lm_weight.device, self.vision_dtype)
        pooled = self.vision_tower(pixels, [span.grid for span in images]).to(self.vision_dtype)
        feats = self.multi_modal_projector(pooled.to(lm_weight.dtype))
        return [f[:, None] for f in feats.split([span.num_embeds for span in images])]
