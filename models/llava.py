"""LLaVA-1.5 (`LlavaForConditionalGeneration`): vision tower -> MLP projector -> decoder LM, every
image the same number of tokens, spliced into the embeddings at the image-token positions.

The vision tower is transformers' own CLIP or SigLIP vision model (an encoder that needs no paged
cache), cut after the deepest layer LLaVA reads, and may run in its own dtype (float16 on CUDA).
Preprocessing is the engine's own torchvision copy of the CLIP/SigLIP processors
(vision/preprocess.py). Two key layouts are found in the wild: the original one
(`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`) and the one
transformers writes since 4.52 (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.models.interface import MultimodalModel, ProcessedImage, Processing
from mm_engine.models.layers.decoder import DecoderLM
from mm_engine.models.layers.packed_linear import PackedLinear
from mm_engine.models.layers.vit_tower import VitTower, own_tower_kind, tower_state
from mm_engine.models.platform import Platform
from mm_engine.models.weights import (
    build_language_model,
    load_strict,
    materialize,
    read_weights,
    ready,
)
from mm_engine.parallel.group import TPGroup
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash
from mm_engine.vision.preprocess import ImagePreprocessor, load_image_processor_config

ARCHITECTURES = ("LlavaForConditionalGeneration",)
SUPPORTED_TEXT = ("llama", "mistral", "qwen2")
SUPPORTED_VISION = ("clip_vision_model", "siglip_vision_model")


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias, dtype=dtype)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))

    @property
    def dtype(self) -> torch.dtype:
        first = self.linear_1
        return first.dtype if isinstance(first, PackedLinear) else first.weight.dtype


def feature_layers(config) -> list[int]:
    """LLaVA's `vision_feature_layer` (int or list) as non-negative hidden-state indices."""
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    n = config.vision_config.num_hidden_layers
    out = [idx if idx >= 0 else n + 1 + idx for idx in layers]
    if any(not 0 <= idx <= n for idx in out):
        raise ValueError(f"vision_feature_layer {config.vision_feature_layer} is out of range for {n} layers")
    return out


def tokens_per_image(config) -> int:
    """Image tokens one image expands to: patches, plus CLIP's class token, minus it for 'default'."""
    vc = config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    if vc.model_type == "clip_vision_model":
        n += 1
    if config.vision_feature_select_strategy == "default":
        n -= 1
    return n


def check_config(config) -> None:
    if config.text_config.model_type not in SUPPORTED_TEXT:
        raise ValueError(
            f"unsupported language model {config.text_config.model_type!r}; supported: {SUPPORTED_TEXT}"
        )
    if config.vision_config.model_type not in SUPPORTED_VISION:
        raise ValueError(
            f"unsupported vision tower {config.vision_config.model_type!r}; supported: {SUPPORTED_VISION}"
        )


class LlavaProcessing(Processing):
    """One placeholder becomes `tokens_per_image` image tokens, all of them embeddings."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        if kwargs:
            raise ValueError(f"mm_processor_kwargs are not supported for LLaVA-1.5: {', '.join(kwargs)}")
        self.preprocessor = ImagePreprocessor.from_config(load_image_processor_config(path))
        self.image_token_id = config.image_token_index
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.tokens_per_image = self.fixed_tokens = tokens_per_image(config)
        self._salt = self.preprocessor.settings_key()

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        if overrides:
            raise ValueError(f"mm_processor_kwargs are not supported for LLaVA-1.5: {', '.join(overrides)}")
        n, pixels = self.tokens_per_image, self.preprocessor(image)
        return ProcessedImage(
            pixels, [self.image_token_id] * n, None, n, image_content_hash(image, self._salt)
        )


class LlavaModel(MultimodalModel):
    extra_weights: tuple[str, ...] = ()  # top-level parameters beside tower, projector and LM

    def __init__(
        self, config, vision_tower: VitTower, language_model: DecoderLM, projector_bias: bool,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        """`dtype`: the projector's (and any extra weights'), the language model's."""
        super().__init__()
        self.config = config
        self.layers = feature_layers(config)
        self.vision_tower = vision_tower
        in_dim = config.vision_config.hidden_size * len(self.layers)
        self.multi_modal_projector = Projector(
            in_dim, config.text_config.hidden_size, config.projector_hidden_act, projector_bias, dtype
        )
        self.language_model = language_model
        self.image_token_id = config.image_token_index
        self.tokens_per_image = tokens_per_image(config)

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(self.vision_tower.parameters()).dtype

    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        pixels = torch.stack([span.pixel_values for span in images])
        return list(self.encode_images(pixels.to(self.language_model.embed_tokens.weight.device))[:, :, None])

    @classmethod
    def from_checkpoint(
        cls, path: Path, config, dtype: torch.dtype, vision_dtype: torch.dtype, device: torch.device,
        platform: Platform, pack_weights: bool, tp: TPGroup | None = None,
    ) -> LlavaModel:  # fmt: skip
        vision_state, projector_state, lm_state, extra = split_weights(read_weights(path), cls.extra_weights)
        extra = materialize(extra)
        lm = build_language_model(lm_state, config.text_config, dtype, device, platform.ops, tp=tp)
        kind = own_tower_kind(config.vision_config)  # CLIP or SigLIP: check_config refused the rest
        layers = feature_layers(config)
        tower = VitTower(config.vision_config, layers, platform.ops).to(device=device, dtype=vision_dtype)
        load_strict(tower, tower_state(materialize(vision_state), max(layers), kind), "vision tower")
        with torch.device(device):
            model = cls(config, tower, lm, "linear_1.bias" in projector_state, dtype)
        load_strict(model.multi_modal_projector, projector_state, "projector")
        for name in cls.extra_weights:
            if name not in extra:
                raise ValueError(f"the checkpoint has no {name!r} weight")
            with torch.no_grad():
                getattr(model, name).copy_(extra[name])
        return ready(model, platform, pack_weights)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_image, text hidden size] in the LM's dtype."""
        pixels = pixel_values.to(self.vision_dtype)
        feats = self.vision_tower(pixels)
        if self.config.vision_feature_select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        feats = torch.cat(feats, dim=-1)
        return self.multi_modal_projector(feats.to(self.multi_modal_projector.dtype))


def split_weights(state: dict[str, torch.Tensor], extra_keys: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """Canonical (vision tower, projector, language model, extra) state dicts from either layout;
    `extra_keys` are top-level weights (LLaVA-NeXT's `image_newline`)."""
    vision, projector, lm, extra = {}, {}, {}, {}
    for key, tensor in state.items():
        k = key.removeprefix("model.")
        if k in extra_keys:
            extra[k] = tensor
        elif k.startswith("lm_head."):
            lm[k] = tensor
        elif k.startswith("language_model."):
            rest = k.removeprefix("language_model.")
            lm[rest if rest.startswith("lm_head.") else rest.removeprefix("model.")] = tensor
        elif k.startswith("vision_tower."):
            vision[k.removeprefix("vision_tower.").removeprefix("vision_model.")] = tensor
        elif k.startswith("multi_modal_projector."):
            projector[k.removeprefix("multi_modal_projector.")] = tensor
        else:
            raise ValueError(f"unexpected weight {key!r} in a LLaVA checkpoint")
    return vision, projector, lm, extra
