"""Torchvision preprocessing that reproduces the model's own Hugging Face image processor.

transformers 5 processes CLIP and SigLIP images with its torchvision backend: PIL image ->
RGB (alpha composited on white) -> uint8 CHW tensor -> resize -> center crop -> float32
rescale and normalize fused into one step. Each step below mirrors that code, down to the
interpolation mode, antialiasing, crop offsets and the float32 arithmetic, so `pixel_values`
match to float rounding (tests check 1e-4) on the same device. Run it on CPU tensors: the
uint8 resize kernels differ between CPU and CUDA.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

from .image_io import ImageError

_SETTINGS_VERSION = 1  # bump when the pixels produced for the same settings change

# PIL resample ids as transformers maps them (it uses NEAREST_EXACT for PIL's NEAREST).
_INTERPOLATION = {
    0: InterpolationMode.NEAREST_EXACT,
    2: InterpolationMode.BILINEAR,
    3: InterpolationMode.BICUBIC,
}

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# transformers' class defaults, used for keys a config leaves out or sets to null.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
        "default_to_square": False,
    },
    "siglip": {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": False,
        "crop_size": None,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "default_to_square": False,
    },
}

_KINDS = {
    "CLIPImageProcessor": "clip",
    "CLIPImageProcessorFast": "clip",
    "CLIPFeatureExtractor": "clip",
    "SiglipImageProcessor": "siglip",
    "SiglipImageProcessorFast": "siglip",
}

# Options that change the output in ways this module does not reproduce.
_UNSUPPORTED_OPTIONS = ("do_pad", "image_grid_pinpoints", "use_square_size")

_CONFIG_FILE = "preprocessor_config.json"
_PROCESSOR_FILE = "processor_config.json"


def load_image_processor_config(model_dir: str | Path) -> dict[str, Any]:
    """The image processor settings saved with a model.

    Same precedence as transformers: the "image_processor" entry of processor_config.json,
    else preprocessor_config.json.
    """
    model_dir = Path(model_dir)
    processor_file = model_dir / _PROCESSOR_FILE
    if processor_file.is_file():
        nested = json.loads(processor_file.read_text()).get("image_processor")
        if isinstance(nested, dict):
            return nested
    config_file = model_dir / _CONFIG_FILE
    if config_file.is_file():
        return json.loads(config_file.read_text())
    raise ValueError(
        f"no image processor settings in the model folder: expected {_CONFIG_FILE} or an "
        f'"image_processor" entry in {_PROCESSOR_FILE}'
    )


@dataclass(frozen=True, slots=True)
class ImagePreprocessor:
    do_convert_rgb: bool = True
    do_resize: bool = True
    size: int | tuple[int, int] = (224, 224)  # int: short side to it, keeping aspect; else (h, w)
    resample: int = 3
    do_center_crop: bool = False
    crop_size: tuple[int, int] | None = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.do_resize and self.resample not in _INTERPOLATION:
            raise ValueError(
                f"resample {self.resample} is not supported: use 0 (nearest), 2 (bilinear) or 3 (bicubic)"
            )
        if self.do_normalize and not all(self.image_std):
            raise ValueError("image_std must not contain zeros")
        if not self.do_center_crop and not (self.do_resize and isinstance(self.size, tuple)):
            raise ValueError(
                "the output size would depend on the image: a center crop, or a resize to "
                "height and width, is required"
            )

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ImagePreprocessor:
        """Build from a CLIP or SigLIP image processor config (preprocessor_config.json)."""
        kind_name = cfg.get("image_processor_type") or cfg.get("feature_extractor_type")
        kind = _KINDS.get(kind_name)
        if kind is None:
            raise ValueError(
                f"image processor {kind_name!r} is not supported: supported are CLIPImageProcessor and "
                "SiglipImageProcessor"
            )
        for option in _UNSUPPORTED_OPTIONS:
            if cfg.get(option):
                raise ValueError(
                    f"image processor option {option!r} is not supported: supported are resize, "
                    "center crop, rescale and normalize"
                )
        c = _DEFAULTS[kind] | {k: v for k, v in cfg.items() if v is not None}
        size = _size_dict(c["size"], c["default_to_square"], "size")
        crop = _size_dict(c["crop_size"], True, "crop_size") if c["do_center_crop"] else None
        if crop is not None and "height" not in crop:
            raise ValueError(f"crop_size must have height and width, got {c['crop_size']!r}")
        return cls(
            do_convert_rgb=bool(c["do_convert_rgb"]),
            do_resize=bool(c["do_resize"]),
            size=size["shortest_edge"] if "shortest_edge" in size else (size["height"], size["width"]),
            resample=int(c["resample"]),
            do_center_crop=bool(c["do_center_crop"]),
            crop_size=(crop["height"], crop["width"]) if crop else None,
            do_rescale=bool(c["do_rescale"]),
            rescale_factor=float(c["rescale_factor"]),
            do_normalize=bool(c["do_normalize"]),
            image_mean=_per_channel(c["image_mean"], "image_mean"),
            image_std=_per_channel(c["image_std"], "image_std"),
        )

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every output."""
        return self.crop_size if self.do_center_crop else self.size

    def settings_key(self) -> bytes:
        """Stable bytes naming these settings, to salt image content hashes."""
        return json.dumps({"version": _SETTINGS_VERSION, **asdict(self)}, sort_keys=True).encode()

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """float32 [3, H, W] pixel values for one PIL image."""
        x = self._to_uint8_chw(image)
        if self.do_resize:
            size = self._resized_hw(*x.shape[-2:])
            x = tvF.resize(x, list(size), interpolation=_INTERPOLATION[self.resample], antialias=True)
        if self.do_center_crop:
            x = _center_crop(x, *self.crop_size)
        return self._rescale_and_normalize(x)

    def batch(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """float32 [N, 3, H, W] pixel values."""
        if not images:
            return torch.empty((0, 3, *self.output_size), dtype=torch.float32)
        return torch.stack([self(image) for image in images])

    def _to_uint8_chw(self, image: Image.Image) -> torch.Tensor:
        if self.do_convert_rgb:
            image = _to_rgb(image)
        elif image.mode != "RGB":
            raise ImageError(
                f"image mode {image.mode} is not RGB, and the model's processor does not convert images"
            )
        return tvF.pil_to_tensor(image)

    def _resized_hw(self, height: int, width: int) -> tuple[int, int]:
        if isinstance(self.size, tuple):
            return self.size
        # transformers' get_resize_output_image_size: the long side is truncated, not rounded.
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.size * long / short)
        return (new_long, self.size) if width <= height else (self.size, new_long)

    def _rescale_and_normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.do_normalize:
            mean, std = self.image_mean, self.image_std
            if self.do_rescale:
                # transformers folds the rescale into the normalization, in float32:
                # (x - mean / factor) / (std / factor), which rounds differently from x * factor first.
                mean = torch.tensor(mean, dtype=torch.float32) * (1.0 / self.rescale_factor)
                std = torch.tensor(std, dtype=torch.float32) * (1.0 / self.rescale_factor)
            return tvF.normalize(x.to(torch.float32), mean, std)
        if self.do_rescale:
            return x * self.rescale_factor
        return x.to(torch.float32)


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: any alpha band or transparency key is composited on white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """transformers' center crop: zero-pad up to the crop size first, then offsets truncated."""
    h, w = x.shape[-2:]
    if height > h or width > w:
        pad_h, pad_w = max(height - h, 0), max(width - w, 0)
        x = tvF.pad(x, [pad_w // 2, pad_h // 2, (pad_w + 1) // 2, (pad_h + 1) // 2], fill=0)
        h, w = x.shape[-2:]
    return tvF.crop(x, int((h - height) / 2.0), int((w - width) / 2.0), height, width)


def _size_dict(value: Any, default_to_square: bool, name: str) -> dict[str, int]:
    """A size setting in transformers' forms (int, [h, w] or dict) as a dict."""
    if isinstance(value, int):
        return {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict):
        given = {k: v for k, v in value.items() if v is not None}
        if set(given) in ({"shortest_edge"}, {"height", "width"}):
            return given
    raise ValueError(
        f'{name} {value!r} is not supported: use {{"shortest_edge": n}} or {{"height": h, "width": w}}'
    )


def _per_channel(value: Any, name: str) -> tuple[float, float, float]:
    values = (value,) * 3 if isinstance(value, (int, float)) else tuple(value)
    if len(values) != 3:
        raise ValueError(f"{name} must have 3 values (one per RGB channel), got {len(values)}")
    return tuple(float(v) for v in values)
