"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`).

An image is resized within the processor's min/max pixels to a multiple of patch x merge size,
cut into patches (each frame twice along time: `temporal_patch_size` 2), encoded by a ViT over
all images of a step packed into one sequence (attention stays inside each image; Qwen2.5's tower
also inside windows, except in its full-attention layers), and every 2x2 patches merge into one
token. The prompt's `<|image_pad|>` becomes one pad per merged token, all of them embeddings; the
language model is Qwen2's, with M-RoPE positions (mrope.py).

The tower (every version's: Qwen2-VL to Qwen3.5) is the engine's own (models/layers/qwen_vision.py),
loaded straight from the checkpoint; the language model runs on the engine's paged layers.
Checkpoints come as `model.*` + `visual.*` + `lm_head.*` (as published) or `model.language_model.*`
+ `model.visual.*` (as transformers 5 lays the modules out); both load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.kernels.host_copy import to_device
from mm_engine.models.interface import MultimodalModel, Positions, ProcessedImage, Processing
from mm_engine.models.layers.decoder import DecoderLM, mrope_streams
from mm_engine.models.layers.qwen_vision import QwenVisionTower
from mm_engine.models.mrope import mrope_positions
from mm_engine.models.options import SAMPLING_OPTIONS, frame_sampling, positive_option
from mm_engine.models.platform import Platform
from mm_engine.models.weights import (
    build_language_model,
    load_strict,
    materialize,
    read_weights,
    ready,
    split_by_prefix,
)
from mm_engine.parallel.group import TPGroup
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash
from mm_engine.vision.video_io import FrameSampling, Video, video_content_hash

# Processor options a request or server may set (`mm_processor_kwargs`), as vLLM spells them:
# pixels per image and per video frame, then a video's sampling and its token budget.
PIXEL_OPTIONS = ("min_pixels", "max_pixels")
OPTIONS = (*PIXEL_OPTIONS, *SAMPLING_OPTIONS, "max_video_tokens")
VIDEO_VERSIONS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Qwen3-VL and Qwen3.5 write each temporal patch as `<t seconds><|vision_start|>` + its tokens +
# `<|vision_end|>` (the time in text, the patch at time position 0), sampled by their own rule.
TIMESTAMP_VERSIONS = VIDEO_VERSIONS[2:]
DEFAULT_FPS = 2.0  # what Qwen's own tooling samples at
VERSION_NAMES = {
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
}


def check_config(config) -> None:
    text = config.text_config
    if getattr(text, "use_sliding_window", False):
        raise ValueError("sliding-window attention in the language model is not supported")
    section = (text.rope_parameters or {}).get("mrope_section")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if not section or sum(section) != head_dim // 2:
        raise ValueError(f"rope_parameters.mrope_section {section} must cover head_dim / 2 = {head_dim // 2}")


class QwenProcessing(Processing):
    """The checkpoint's own Qwen image processor (transformers'), one image per call; options
    `min_pixels` / `max_pixels` from the server, then from the request."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoImageProcessor

        self.hf = AutoImageProcessor.from_pretrained(path)
        self.merge = self.hf.merge_size
        self.image_token_id = config.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.size = self._size({}, kwargs)
        settings = self.hf.to_dict()
        self._salt = json.dumps(settings, sort_keys=True, default=str)
        self.video_hf = None
        self.model_type = config.model_type
        if config.model_type in VIDEO_VERSIONS and getattr(config, "video_token_id", None) is not None:
            self._init_video(path, tokenizer, config, kwargs)

    def _init_video(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None) -> None:
        from transformers import AutoVideoProcessor

        hf = self.video_hf = AutoVideoProcessor.from_pretrained(path)
        self.video_token_id = config.video_token_id
        self.video_token = tokenizer.convert_ids_to_tokens(self.video_token_id)
        self.video_size = self._size(
            {"shortest_edge": hf.size.shortest_edge, "longest_edge": hf.size.longest_edge}, kwargs
        )
        self.timestamps = config.model_type in TIMESTAMP_VERSIONS
        if self.timestamps:
            self.video_wrapper = (config.vision_start_token_id, config.vision_end_token_id)
            self._tokenizer = tokenizer
        base = FrameSampling(DEFAULT_FPS, None, hf.min_frames, hf.max_frames, hf.temporal_patch_size,
                             spread="linspace" if self.timestamps else "even")  # fmt: skip
        self.sampling = frame_sampling(base, kwargs)
        self.max_video_tokens = self._video_tokens(hf.max_video_tokens, kwargs)
        # Qwen2.5-VL spaces a video's M-RoPE time positions by seconds; Qwen2-VL counts patches.
        self.tokens_per_second = getattr(config.vision_config, "tokens_per_second", None)
        if config.model_type != "qwen2_5_vl":
            self.tokens_per_second = None
        self._video_salt = json.dumps(hf.to_dict(), sort_keys=True, default=str)

    def _size(self, base: dict, options: Mapping[str, Any] | None) -> dict:
        """The processor's `size` (shortest_edge = min pixels, longest_edge = max pixels)."""
        size = dict(base) or {
            "shortest_edge": self.hf.size.shortest_edge,
            "longest_edge": self.hf.size.longest_edge,
        }
        for key, value in (options or {}).items():
            if key not in OPTIONS:
                raise ValueError(
                    f"unknown mm_processor_kwargs option {key!r}; supported: {', '.join(OPTIONS)}"
                )
            if key not in PIXEL_OPTIONS:
                continue  # a video's: checked where videos are read
            value = positive_option(key, value)
            size["shortest_edge" if key == "min_pixels" else "longest_edge"] = value
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(
                f"min_pixels ({size['shortest_edge']}) is larger than max_pixels ({size['longest_edge']})"
            )
        return size

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        size = self._size(self.size, overrides)
        out = self.hf(images=[image], size=size, return_tensors="pt")
        grid = tuple(int(g) for g in out["image_grid_thw"][0])
        n = grid[0] * grid[1] * grid[2] // self.merge**2
        salt = f"{self._salt}|{size['shortest_edge']}:{size['longest_edge']}".encode()
        return ProcessedImage(
            out["pixel_values"], [self.image_token_id] * n, None, n, image_content_hash(image, salt), grid
        )

    def video_sampling(self, overrides: Mapping[str, Any] | None = None) -> FrameSampling:
        if self.video_hf is None:
            name = VERSION_NAMES.get(self.model_type, self.model_type)
            raise ValueError(
                f"this {name} checkpoint has no video placeholder (video_token_id) to read video with"
            )
        return frame_sampling(self.sampling, overrides)

    @staticmethod
    def _video_tokens(default: int, options: Mapping[str, Any] | None) -> int:
        value = (options or {}).get("max_video_tokens")
        return default if value is None else positive_option("max_video_tokens", value)

    def process_video(
        self, video: Video, overrides: Mapping[str, Any] | None = None, group_tokens: int | None = None
    ) -> list[ProcessedImage]:
        """The video processor on the sampled frames, its per-frame pixels bounded by an even share
        of `max_video_tokens` as Qwen's reference tooling does (`cap_pixels_per_frame`). The
        tower attends within each temporal patch only, so a clip splits into groups of whole
        patches that encode alone to the same features."""
        if self.video_hf is None:
            return super().process_video(video, overrides, group_tokens)
        size = self._size(self.video_size, overrides)
        budget = self._video_tokens(self.max_video_tokens, overrides)
        out = self.video_hf(
            videos=[video.frames], size=size, do_sample_frames=False, cap_pixels_per_frame=True,
            max_video_tokens=budget, return_tensors="pt",
        )  # fmt: skip
        t, h, w = (int(g) for g in out["video_grid_thw"][0])
        per_patch = h * w // self.merge**2  # tokens of one temporal patch
        step = 1.0
        if self.tokens_per_second is not None:  # as transformers computes it, in float32
            seconds = torch.tensor(self.video_hf.temporal_patch_size / video.sampled_fps, dtype=torch.float32)
            step = float(self.tokens_per_second * seconds)
        salt = f"{self._video_salt}|{size['shortest_edge']}:{size['longest_edge']}|{budget}|{step}".encode()
        digest = video_content_hash(video, salt)
        pixels = out["pixel_values_videos"].view(t, h * w, -1)
        if self.timestamps:
            return self._frames(video, pixels, (h, w), digest)
        size_of = max(1, (group_tokens or t * per_patch) // per_patch)  # temporal patches a group
        groups = []
        for first in range(0, t, size_of):
            n = min(size_of, t - first)
            key = digest if n == t else f"{digest}:{first}+{n}"
            rows = pixels[first : first + n].reshape(n * h * w, -1)
            tokens = [self.video_token_id] * (n * per_patch)
            groups.append(ProcessedImage(rows, tokens, None, len(tokens), key, (n, h, w), step, first))
        return groups

    def _frames(
        self, video: Video, pixels: torch.Tensor, hw: tuple[int, int], digest: str
    ) -> list[ProcessedImage]:
        """Qwen3-VL's clip: each temporal patch a run of its own, at the middle of its frames'
        times in seconds (transformers' `_calculate_timestamps`), between its own start and end."""
        patch = self.video_hf.temporal_patch_size
        indices = list(video.indices) + [video.indices[-1]] * (-len(video.indices) % patch)
        times = [i / video.fps for i in indices]
        start, end = self.video_wrapper
        runs = []
        for k in range(pixels.shape[0]):
            seconds = (times[k * patch] + times[k * patch + patch - 1]) / 2
            stamp = self._tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"]
            tokens = [self.video_token_id] * (hw[0] * hw[1] // self.merge**2)
            runs.append(ProcessedImage(pixels[k], tokens, None, len(tokens), f"{digest}:{k}", (1, *hw),
                                       text_before=(*stamp, start), text_after=(end,)))  # fmt: skip
        return runs


def _route(key: str) -> tuple[str, str] | None:
    k = key.removeprefix("model.")
    if k.startswith("visual."):
        return "vision", k.removeprefix("visual.")
    if k.startswith("lm_head."):
        return "lm", k
    k = k.removeprefix("language_model.")
    if k.split(".")[0] in ("embed_tokens", "layers", "norm"):
        return "lm", k
    return None


class Qwen2VLModel(MultimodalModel):
    uses_mrope = True
    interleaved_mrope = False
    qk_norm = False
    family = "Qwen2-VL"

    def __init__(self, config, visual: torch.nn.Module, language_model) -> None:
        super().__init__()
        self.config = config
        self.visual = visual
        self.language_model = language_model
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        video = getattr(config, "video_token_id", None)
        if video is not None and config.model_type not in VIDEO_VERSIONS:
            self.refused_tokens = {
                video: f"the video placeholder (token {video}); {self.family} video is not supported yet"
            }

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(self.visual.parameters()).dtype

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        device = self.language_model.embed_tokens.weight.device
        # Pinned, not waited for: with async scheduling the forward in flight goes on meanwhile.
        pixels = torch.cat([span.pixel_values for span in images])
        pixels = to_device(pixels, None, device).to(self.vision_dtype)
        out = self.visual(pixels, [span.grid for span in images])
        feats = torch.stack([out.pooler_output, *self._extras(out)], dim=1)
        feats = feats.to(self.language_model.embed_tokens.weight.dtype)
        return list(feats.split([span.num_embeds for span in images]))

    def _extras(self, out) -> list[torch.Tensor]:
        return []

    def positions(self, token_ids: list[int], images: list[ImageSpan]) -> Positions | None:
        return mrope_positions(len(token_ids), images, self.merge)

    # What a later family of the line changes in loading (Qwen3.5: a hybrid decoder, norms stored
    # as offsets, checkpoint keys to skip; GLM: its decoder and its tower).
    lm_class: type[DecoderLM] = DecoderLM

    @classmethod
    def language_model_class(cls, text_config) -> type[DecoderLM]:
        return cls.lm_class

    @staticmethod
    def route(key: str) -> tuple[str, str] | None:
        return _route(key)

    @staticmethod
    def lm_weights(state: dict, text_config) -> dict:
        return state

    @staticmethod
    def build_tower(config, ops) -> torch.nn.Module:
        return QwenVisionTower(config.vision_config, ops)

    @classmethod
    def from_checkpoint(
        cls, path: Path, config, dtype: torch.dtype, vision_dtype: torch.dtype, device: torch.device,
        platform: Platform, pack_weights: bool, tp: TPGroup | None = None,
    ) -> MultimodalModel:  # fmt: skip
        parts = split_by_prefix(read_weights(path), cls.route, cls.family)
        text = config.text_config
        streams = mrope_streams(text.rope_parameters["mrope_section"], cls.interleaved_mrope)
        weights, lm_class = cls.lm_weights(parts.get("lm", {}), text), cls.language_model_class(text)
        lm = build_language_model(
            weights, text, dtype, device, platform.ops, streams, cls.qk_norm, tp, lm_class
        )  # fmt: skip
        tower = cls.build_tower(config, platform.ops).to(device=device, dtype=vision_dtype)
        load_strict(tower, tower.checkpoint_state(materialize(parts.get("vision", {}))), "vision tower")
        tower.fuse()
        model = cls(config, tower, lm)
        return ready(model, platform, pack_weights)
