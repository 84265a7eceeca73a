"""InternVL in transformers' format (`InternVLForConditionalGeneration`: InternVL3, InternVL2.5-HF).

The processor (transformers' GotOcr2 one) picks the tile grid whose aspect ratio is closest to the
image's, within `min_patches`..`max_patches` tiles, resizes the image onto it, cuts the tiles and
adds a thumbnail of the whole image when there is more than one. Each tile goes through the
InternViT tower; the class token is dropped, a pixel shuffle folds 2x2 patches into one token
(`downsample_ratio` 0.5) and an MLP projects it: `image_seq_length` tokens per tile. The prompt's
`<IMG_CONTEXT>` becomes `<img>` + `<IMG_CONTEXT>` x (tiles x image_seq_length) + `</img>`; only the
context tokens carry embeddings. The language model is Qwen2's or Llama's, with 1-D positions.

Video (the prompt's `<video>`): each sampled frame is resized to one tile (the video processor's
size, no tiling) and written as its processor writes it, `Frame1: <img>...</img>`, frames joined
by a newline; each frame is a span of its own. Frames are sampled at the middle of n equal
segments of the clip (InternVL's `initial_shift`), n = 8 unless `num_frames` or `fps` says.

The tower is the engine's InternViT (layers/vit_tower.py), the projector transformers' module;
the language model runs on the engine's paged layers.
Weights: `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*` (tied in the tiny test checkpoints).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.models.frame_video import FrameVideo
from mm_engine.models.interface import ProcessedImage
from mm_engine.models.layers.vit_tower import VitTower, tower_state
from mm_engine.models.llava import feature_layers
from mm_engine.models.options import SAMPLING_OPTIONS, positive_option
from mm_engine.models.platform import Platform
from mm_engine.models.tower_projector import TowerProjectorModel
from mm_engine.models.weights import load_strict
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash
from mm_engine.vision.video_io import FrameSampling

SUPPORTED_TEXT = ("llama", "qwen2", "qwen3", "mistral")
DEFAULT_FRAMES = 8  # a clip's frames unless the request says (InternVL's own examples' count)
# mm_processor_kwargs: transformers' names, and vLLM's for the same two settings.
TILE_OPTIONS = {
    "min_patches": "min_patches",
    "max_patches": "max_patches",
    "min_dynamic_patch": "min_patches",
    "max_dynamic_patch": "max_patches",
}


def check_config(config) -> None:
    if config.text_config.model_type not in SUPPORTED_TEXT:
        raise ValueError(
            f"unsupported language model {config.text_config.model_type!r}; supported: {SUPPORTED_TEXT}"
        )
    if config.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
    if int(1 / config.downsample_ratio) * config.downsample_ratio != 1:
        raise ValueError(f"downsample_ratio must be 1 / an integer, got {config.downsample_ratio}")


class InternVLProcessing(FrameVideo):
    """The checkpoint's own image processor (transformers'), one image per call, tiling on."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(path)
        self.hf = hf.image_processor
        self.seq_len = hf.image_seq_length
        self.image_token = hf.image_token
        self.image_token_id = hf.image_token_id
        self.start_id, self.end_id = hf.start_image_token_id, hf.end_image_token_id
        defaults = {"min_patches": self.hf.min_patches, "max_patches": self.hf.max_patches}
        self.tiles = self._tiles(defaults, kwargs)
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str)
        video_hf, video = getattr(hf, "video_processor", None), getattr(hf, "video_token", None)
        if video_hf is not None and video in tokenizer.get_vocab():
            self._tokenizer = tokenizer
            base = FrameSampling(None, DEFAULT_FRAMES, spread="centers")
            self.init_video(video_hf, video, tokenizer.convert_tokens_to_ids(video), base, kwargs)

    @staticmethod
    def _tiles(base: dict[str, int], options: Mapping[str, Any] | None) -> dict[str, int]:
        out = dict(base)
        for key, value in (options or {}).items():
            if key in SAMPLING_OPTIONS:
                continue  # a video's: checked where videos are read
            if key not in TILE_OPTIONS:
                known = ", ".join([*TILE_OPTIONS, *SAMPLING_OPTIONS])
                raise ValueError(f"unknown mm_processor_kwargs option {key!r}; supported: {known}")
            value = positive_option(key, value)
            out[TILE_OPTIONS[key]] = value
        if out["min_patches"] > out["max_patches"]:
            raise ValueError(
                f"min_patches ({out['min_patches']}) is larger than max_patches ({out['max_patches']})"
            )
        return out

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        tiles = self._tiles(self.tiles, overrides)
        out = self.hf(images=[image], crop_to_patches=True, return_tensors="pt", **tiles)
        pixels = out["pixel_values"]
        n = pixels.shape[0] * self.seq_len
        tokens = [self.start_id, *([self.image_token_id] * n), self.end_id]
        mask = (False, *([True] * n), False)
        digest = image_content_hash(
            image, f"{self._salt}|{tiles['min_patches']}:{tiles['max_patches']}".encode()
        )
        return ProcessedImage(pixels, tokens, mask, n, digest)

    def check_options(self, options: Mapping[str, Any] | None) -> None:
        self._tiles(self.tiles, options)

    def frame_run(self, index: int, last: bool, pixels: torch.Tensor, key: str) -> ProcessedImage:
        """One tile, between `FrameN: <img>` (after a newline but for the first) and `</img>`."""
        label = self._tokenizer(f"{chr(10) if index else ''}Frame{index + 1}: ", add_special_tokens=False)
        tokens = [self.image_token_id] * self.seq_len
        before = (*label["input_ids"], self.start_id)
        return ProcessedImage(
            pixels, tokens, None, self.seq_len, key, text_before=before, text_after=(self.end_id,)
        )


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """`[tiles, side, side, C]` -> `[tiles, side / f, side / f, C * f * f]`: each output token holds
    its f x f block of patches, row by row (the order InternVL was trained with)."""
    n, rows, cols, c = x.shape
    x = x.reshape(n, rows // factor, factor, cols // factor, factor, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, rows // factor, cols // factor, factor * factor * c)


class InternVLModel(TowerProjectorModel):
    family = "InternVL"

    def __init__(self, config, vision_tower: torch.nn.Module, projector: torch.nn.Module, language_model):
        super().__init__(config, vision_tower, projector, language_model)
        self.factor = int(1 / config.downsample_ratio)

    @classmethod
    def build_tower(cls, state: dict, config, platform: Platform) -> VitTower:
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("a list of vision_feature_layer values is not supported for InternVL")
        (layer,) = feature_layers(config)
        # -1 reads `last_hidden_state`: through the final norm, unless the tower mean-pools.
        post_norm = config.vision_feature_layer == -1 and not config.vision_config.use_mean_pooling
        tower = VitTower(config.vision_config, [layer], platform.ops, post_norm=post_norm)
        load_strict(tower, tower_state(state, layer, "internvit", post_norm), "vision tower")
        return tower

    @staticmethod
    def projector_class():
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        return InternVLMultiModalProjector

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        lm_weight = self.language_model.embed_tokens.weight
        pixels = torch.cat([span.pixel_values for span in images]).to(lm_weight.device, self.vision_dtype)
        (feats,) = self.vision_tower(pixels)
        if self.config.vision_feature_select_strategy == "default":
            feats = feats[:, 1:]  # the class token
        side = int(feats.shape[1] ** 0.5)
        feats = pixel_shuffle(feats.reshape(feats.shape[0], side, side, -1), self.factor)
        feats = self.multi_modal_projector(
            feats.reshape(feats.shape[0], -1, feats.shape[-1]).to(lm_weight.dtype)
        )
        feats = feats.reshape(-1, 1, feats.shape[-1])
        return list(feats.split([span.num_embeds for span in images]))
