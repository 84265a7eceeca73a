"""LLaVA-NeXT and LLaVA-OneVision (`LlavaNextForConditionalGeneration`,
`LlavaOnevisionForConditionalGeneration`): LLaVA's tower and projector with "anyres" images.

The processor picks the best grid for the image from `image_grid_pinpoints`, and cuts the image
resized onto it into tiles at the tower's resolution, after a base tile of the whole image. All
tiles go through the tower and projector; the tiles' features are laid out as one feature map,
the padding the resize added is cut off again ("unpadding"), OneVision shrinks a map larger than
`vision_aspect_ratio` allows (bilinear), and a learned `image_newline` ends every row; the base
tile's features come first. OneVision tiles an image only when it is its prompt's only image;
otherwise the image is padded square and becomes one tile (plus a newline). Every position of the
placeholder run carries an embedding (newlines are embeddings too). The token count per image is
the checkpoint's processor's own (`replace_image_token`), the layout the model's, and the two are
checked against each other at every encoding.

OneVision's video (the prompt's `<video>`): each sampled frame at the tower's resolution, its
projected features pooled 2x2 (bilinear, as transformers' `apply_pooling`), the frames one after
another and one `image_newline` after the last. Each frame is a span of its own (the last one
token longer, for the newline). Frames: `num_frames` (8 by default) at `i x total // n`, or
`int(seconds x fps)` with `fps`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from mm_engine.models.frame_video import FrameVideo
from mm_engine.models.interface import ProcessedImage
from mm_engine.models.llava import LlavaModel, check_config
from mm_engine.models.options import SAMPLING_OPTIONS
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash
from mm_engine.vision.video_io import FrameSampling

__all__ = ["LlavaNextModel", "LlavaNextProcessing", "check_config"]
DEFAULT_FRAMES = 8  # a clip's frames unless the request says (transformers' OneVision example)


def _hf():
    from transformers.models.llava_next import modeling_llava_next

    return modeling_llava_next


class LlavaNextProcessing(FrameVideo):
    """The checkpoint's own processor (transformers'), on all images of a prompt at once."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        self.proc = AutoProcessor.from_pretrained(path)
        self.hf = self.proc.image_processor
        self.image_token = self.proc.image_token
        self.image_token_id = config.image_token_index
        self.onevision = config.model_type == "llava_onevision"
        self.pinpoints = config.image_grid_pinpoints
        self.tile = config.vision_config.image_size
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str)
        video_hf = getattr(self.proc, "video_processor", None) if self.onevision else None
        token_id = getattr(config, "video_token_index", None)
        if video_hf is not None and token_id is not None:
            side = config.vision_config.image_size // config.vision_config.patch_size
            self.pooled = math.ceil(side / 2) ** 2  # a frame's tokens, pooled 2x2
            base = FrameSampling(None, DEFAULT_FRAMES, min_frames=1, spread="uniform")
            self.init_video(video_hf, tokenizer.convert_ids_to_tokens(token_id), token_id, base, kwargs)
        else:
            self.check_options(kwargs)

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        return self.process_images([image], overrides)[0]

    def process_images(
        self, images: list[Image.Image], overrides: Mapping[str, Any] | None = None
    ) -> list[ProcessedImage]:
        self.check_options(overrides)
        # OneVision's processor learns from the nesting how many images share the prompt.
        out = self.hf(images=[list(images)] if self.onevision else list(images), return_tensors="pt")
        tiled = not (self.onevision and len(images) > 1)
        result = []
        for i, image in enumerate(images):
            n = self.proc.replace_image_token(out, i).count(self.image_token)
            size = [int(v) for v in out["image_sizes"][i]]
            tiles = _hf().image_size_to_num_patches(size, self.pinpoints, self.tile) if tiled else 1
            salt = f"{self._salt}|{'tiled' if tiled else 'square'}".encode()
            result.append(
                ProcessedImage(
                    out["pixel_values"][i][:tiles],
                    [self.image_token_id] * n,
                    None,
                    n,
                    image_content_hash(image, salt),
                    grid=tuple(size),
                )  # fmt: skip
            )
        return result

    def check_options(self, options: Mapping[str, Any] | None) -> None:
        """Only a video's sampling options, where this checkpoint reads video."""
        unknown = [k for k in options or {} if self.video_token_id is None or k not in SAMPLING_OPTIONS]
        if unknown:
            raise ValueError(f"mm_processor_kwargs are not supported for this family: {', '.join(unknown)}")

    def frame_run(self, index: int, last: bool, pixels: torch.Tensor, key: str) -> ProcessedImage:
        n = self.pooled + last  # the newline after the clip's last frame
        return ProcessedImage(pixels, [self.video_token_id] * n, None, n, key)


class LlavaNextModel(LlavaModel):
    extra_weights = ("image_newline",)

    def __init__(
        self, config, vision_tower: nn.Module, language_model, projector_bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__(config, vision_tower, language_model, projector_bias, dtype)
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size, dtype=dtype))
        self.side = config.vision_config.image_size // config.vision_config.patch_size
        ratio = getattr(config, "vision_aspect_ratio", None)  # OneVision: "anyres_max_9"
        self.max_tiles = int(ratio.removeprefix("anyres_max_")) if ratio else None

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        pixels = torch.cat([span.pixel_values for span in images])
        feats = self.encode_images(pixels.to(self.language_model.embed_tokens.weight.device))
        out = []
        for span, f in zip(images, feats.split([s.pixel_values.shape[0] for s in images]), strict=True):
            packed = self._pool_frame(f[0], span.num_embeds) if span.video else self._pack(f, list(span.grid))
            if packed.shape[0] != span.num_embeds:
                raise ValueError(
                    f"an image packs into {packed.shape[0]} features for {span.num_embeds} tokens"
                )
            out.append(packed[:, None])
        return out

    def _pool_frame(self, feats: torch.Tensor, n: int) -> torch.Tensor:
        """A video frame's `[side * side, hidden]` pooled 2x2 (bilinear); the newline after it when
        its run has room for one (the clip's last frame)."""
        s, d = self.side, feats.shape[-1]
        grid = feats.view(1, s, s, d).permute(0, 3, 1, 2)
        pooled = nn.functional.interpolate(grid, size=[math.ceil(s / 2)] * 2, mode="bilinear")
        pooled = pooled[0].permute(1, 2, 0).reshape(-1, d)
        if n == pooled.shape[0] + 1:
            pooled = torch.cat([pooled, self.image_newline.to(pooled.dtype)[None]])
        return pooled

    def _pack(self, feats: torch.Tensor, size: list[int]) -> torch.Tensor:
        """`[tiles, side * side, hidden]` of one image -> its feature sequence."""
        newline = self.image_newline.to(feats.dtype)
        if feats.shape[0] == 1:
            return torch.cat([feats[0], newline[None]])
        tile = self.config.vision_config.image_size
        rows, cols = _hf().get_anyres_image_grid_shape(size, self.config.image_grid_pinpoints, tile)
        s, d = self.side, feats.shape[-1]
        grid = feats[1:].reshape(rows, cols, s, s, d).permute(4, 0, 2, 1, 3).reshape(d, rows * s, cols * s)
        grid = _hf().unpad_image(grid, size)
        if self.max_tiles is not None:  # OneVision: shrink a map larger than max_tiles tiles
            h, w = grid.shape[1:]
            ratio = math.sqrt(h * w / (self.max_tiles * s * s))
            if ratio > 1.1:
                grid = nn.functional.interpolate(
                    grid[None], [int(h // ratio), int(w // ratio)], mode="bilinear"
                )[0]
        grid = torch.cat([grid, newline[:, None, None].expand(d, grid.shape[1], 1)], dim=-1)
        return torch.cat([feats[0], grid.flatten(1, 2).t()])
