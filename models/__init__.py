"""Model families behind one interface (interface.py): which architectures the engine loads, and
for each its processing and its model. Everything family-specific lives in its file here."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mm_engine.models import checkpoint_quant
from mm_engine.models.interface import MultimodalModel, Processing
from mm_engine.models.platform import Platform
from mm_engine.parallel.group import TPGroup, check_divisible

# architecture -> (module, model class, processing class)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "LlavaForConditionalGeneration": ("llava", "LlavaModel", "LlavaProcessing"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLModel", "QwenProcessing"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLModel", "QwenProcessing"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLModel", "QwenProcessing"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl", "Qwen3VLMoeModel", "QwenProcessing"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5Model", "QwenProcessing"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5MoeModel", "QwenProcessing"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3Model", "Idefics3Processing"),
    "SmolVLMForConditionalGeneration": ("idefics3", "Idefics3Model", "Idefics3Processing"),
    "InternVLForConditionalGeneration": ("internvl", "InternVLModel", "InternVLProcessing"),
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3Model", "PixtralProcessing"),
    "LightOnOcrForConditionalGeneration": ("lighton_ocr", "LightOnOcrModel", "LightOnOcrProcessing"),
    "LlavaNextForConditionalGeneration": ("llava_next", "LlavaNextModel", "LlavaNextProcessing"),
    "LlavaOnevisionForConditionalGeneration": ("llava_next", "LlavaNextModel", "LlavaNextProcessing"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3Model", "Gemma3Processing"),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4Model", "Gemma4Processing"),
    "Glm4vForConditionalGeneration": ("glm4v", "Glm4vModel", "GlmProcessing"),
    "Glm46VForConditionalGeneration": ("glm4v", "Glm46VModel", "GlmProcessing"),
    "Glm4vMoeForConditionalGeneration": ("glm4v", "Glm4vMoeModel", "GlmProcessing"),
    "GlmOcrForConditionalGeneration": ("glm4v", "GlmOcrModel", "GlmProcessing"),
    "PaddleOCRVLForConditionalGeneration": ("paddleocr_vl", "PaddleOCRVLModel", "PaddleOCRProcessing"),
}
# The config's model_type for each, when a config names no architecture.
MODEL_TYPES = {
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "lighton_ocr": "LightOnOcrForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "glm46v": "Glm46VForConditionalGeneration",
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    "glm_ocr": "GlmOcrForConditionalGeneration",
    "paddleocr_vl": "PaddleOCRVLForConditionalGeneration",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else MODEL_TYPES.get(config.model_type, config.model_type)
    if arch not in FAMILIES or MODEL_TYPES.get(config.model_type) != arch:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _family(config):
    module, model_cls, processing_cls = FAMILIES[architecture(config)]
    mod = importlib.import_module(f"mm_engine.models.{module}")
    return mod, getattr(mod, model_cls), getattr(mod, processing_cls)


def check_config(config) -> None:
    """Refuse a config this engine cannot serve, naming what is not supported."""
    mod, _, _ = _family(config)
    mod.check_config(config)
    checkpoint_quant.read(config)  # a stored format this engine does not load is refused


def check_tensor_parallel(config, world: int) -> None:
    """Refuse, before any worker starts, a split the model cannot take."""
    check_divisible(config.text_config, world)


def load_model(
    path: Path,
    config,
    dtype: torch.dtype,
    vision_dtype: torch.dtype,
    device: torch.device,
    platform: Platform,
    pack_weights: bool = False,
    tp: TPGroup | None = None,
) -> MultimodalModel:
    """The family's model on `platform`: its language model on the engine's paged layers and the
    platform's ops, its vision tower in `vision_dtype`. `pack_weights`: on CPU, linears run with
    weights packed at load time (`mm_engine.models.layers.packed_linear`). `tp`: the language model's shard of
    this tensor-parallel rank (the vision tower is whole on every rank)."""
    _, model_cls, _ = _family(config)
    return model_cls.from_checkpoint(path, config, dtype, vision_dtype, device, platform, pack_weights, tp)


def make_processing(path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> Processing:
    """The family's image processing from the checkpoint's processor settings, with the server's
    `mm_processor_kwargs` on top."""
    _, _, processing_cls = _family(config)
    return processing_cls(path, tokenizer, config, kwargs)
