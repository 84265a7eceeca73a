"""What every model family hands the rest of the engine, so that the scheduler, pools, kernels and
API stay family-blind.

A family has two halves:
- a `Processing` (CPU, no weights): per image, the pixel tensors its tower takes, the run of
  placeholder tokens the image takes in the prompt, which of those carry vision embeddings, and a
  content hash that also covers the processing settings;
- a `MultimodalModel` (weights): encode a list of images of any sizes into per-image embeddings,
  compute a request's rotary positions once when it is added, and run the language model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import nn

from mm_engine.models.layers.decoder import DecoderLM
from mm_engine.request import ImageSpan
from mm_engine.vision.video_io import FrameSampling, Video


@dataclass(slots=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # any shape the family's tower takes
    tokens: list[int]  # the run of token ids that replaces the image's one placeholder
    embed_mask: tuple[bool, ...] | None  # which of `tokens` carry embeddings; None: all of them
    num_embeds: int  # vision embeddings the tower produces for it
    content_hash: str  # pixels and processing settings
    grid: tuple[int, ...] | None = None  # the family's patch grid (Qwen: t, h, w), if it has one
    # M-RoPE time positions per temporal patch of a video (Qwen2.5-VL: tokens per second x
    # seconds per patch); 1 for images and for families that count patches.
    temporal_step: float = 1.0
    # A clip encoded in groups of temporal patches: this group's first patch within its clip (a
    # group after the first continues the clip's positions, models/mrope.py).
    time_offset: int = 0
    # Text tokens the prompt gets around this run (Qwen3-VL: a frame's `<t seconds><|vision_start|>`
    # before it and `<|vision_end|>` after): plain text, with text positions.
    text_before: tuple[int, ...] = ()
    text_after: tuple[int, ...] = ()
    # Prompt text around a video frame's run for a family that writes it before the prompt is
    # tokenized (`Processing.video_in_text`; SmolVLM2: the clip's intro and each frame's time).
    prompt_before: str = ""
    prompt_after: str = ""


class Processing:
    """Turns one decoded image into a `ProcessedImage`. `overrides` are per-request processor
    options (`mm_processor_kwargs`) on top of the server's."""

    image_token: str  # the placeholder a prompt writes once per image
    image_token_id: int
    fixed_tokens: int | None = None  # every image takes this many tokens (None: it depends on the image)

    video_token: str | None = None  # the placeholder a prompt writes once per video (None: no video)
    video_token_id: int | None = None
    # (start, end) token ids whose pair around the video placeholder the prompt's expansion drops,
    # since each frame's run brings its own (Qwen3-VL); None: the placeholder is replaced alone.
    video_wrapper: tuple[int, int] | None = None
    # The clip's frames come with text (`ProcessedImage.prompt_before/after`) that is tokenized
    # with the prompt, as the processor does (SmolVLM2): each video placeholder of the prompt
    # text becomes that text with one image placeholder per frame, so a video needs a text prompt.
    video_in_text: bool = False

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        raise NotImplementedError

    def video_sampling(self, overrides: Mapping[str, Any] | None = None) -> FrameSampling:
        """How this family samples a clip's frames, with the request's options (fps, num_frames,
        min_frames, max_frames) over the server's."""
        raise ValueError(f"{type(self).__name__.removesuffix('Processing')} does not read video")

    def process_video(
        self, video: Video, overrides: Mapping[str, Any] | None = None, group_tokens: int | None = None
    ) -> list[ProcessedImage]:
        """One sampled clip -> its run of video tokens and the tower's input (frames as patches),
        in groups of whole temporal patches of at most `group_tokens` tokens each where the
        family's tower encodes each temporal patch on its own (so that one step need not encode a
        long clip whole); the runs are consecutive in the prompt."""
        raise ValueError(f"{type(self).__name__.removesuffix('Processing')} does not read video")

    def process_images(
        self, images: list[Image.Image], overrides: Mapping[str, Any] | None = None
    ) -> list[ProcessedImage]:
        """All images of one prompt, in order. Most families process each alone; one whose rules
        depend on the prompt's other images (LLaVA-OneVision tiles only a prompt's single image)
        overrides this."""
        return [self.process(image, overrides) for image in images]


@dataclass(slots=True)
class Positions:
    """Multimodal rotary positions of a prompt, `[3, prompt tokens]`, and the offset that every
    later token (decode, or recompute after preemption) continues from: position `i + delta`."""

    prompt: torch.Tensor
    delta: int


class MultimodalModel(nn.Module):
    """A vision tower plus connector (family-specific) and the engine's paged `DecoderLM`."""

    language_model: DecoderLM
    image_token_id: int
    uses_mrope: bool = False  # positions are [3, tokens] (Qwen) rather than [tokens]
    num_deepstack: int = 0  # extra per-layer features each image token adds (Qwen3-VL)
    # An image's embedding tokens attend to each other in both directions during prefill (Gemma 3):
    # the runner passes their ranges to attention, the scheduler never splits an image.
    bidirectional_images: bool = False
    # Prompt token ids the engine refuses, with why (a video placeholder, until video lands).
    refused_tokens: Mapping[int, str] = {}

    @property
    def vision_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        """Images of any sizes in one call -> per image `[num_embeds, 1 + num_deepstack, hidden]`:
        the embeddings that replace its placeholder tokens, then the DeepStack features (if any)."""
        raise NotImplementedError

    @property
    def tower_depth(self) -> int:
        """How many layers one encode passes (`layer_boundary` calls: a sliced encode's unit): the
        longest list of like blocks outside the language model, which is the tower's; 0 if none."""
        lists = (
            m
            for name, m in self.named_modules()
            if isinstance(m, nn.ModuleList) and not name.startswith("language_model")
        )
        return max((len(m) for m in lists if len({type(b) for b in m}) == 1), default=0)

    def positions(self, token_ids: list[int], images: list[ImageSpan]) -> Positions | None:
        """Called once when a request is added; None: plain 1-D positions."""
        return None
