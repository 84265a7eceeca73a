"""GLM-4.1V, GLM-4.5V, GLM-4.6V and GLM-OCR (`Glm4vForConditionalGeneration`,
`Glm4vMoeForConditionalGeneration`, `Glm46VForConditionalGeneration`, `GlmOcrForConditionalGeneration`).

Images are processed and placed as in Qwen2-VL (qwen2_vl.py: the checkpoint's own image processor,
one `<|image|>` per merged token between `<|begin_of_image|>` and `<|end_of_image|>`, M-RoPE
positions with contiguous sections); the tower is GLM's (models/layers/glm_vision.py). The
language model is the engine's decoder with what GLM does differently, each a switch of the shared
layers (models/layers/decoder.py):
- sandwich norms: also after attention and after the MLP, before each residual add;
- the rotary turns a head's first `partial_rotary_factor` dims, pairing neighbours (0 with 1,
  2 with 3, ...) rather than halves;
- the MLP's gate and up projections are stored as one `gate_up_proj` (split on load).
GLM-4.1V's heads are always hidden / heads wide; GLM-OCR's follow the config's `head_dim`, its
attention has no biases, and its checkpoints carry a multi-token-prediction layer past the last
one, which is not used. GLM-4.5V and GLM-4.6V (106B-A12B) have a mixture-of-experts language
model (`glm4v_moe_text`): pre-norm layers, q/k/v biases, a rotate_half rotary over half of each
head, the first `first_k_dense_replace` layers dense and the rest experts chosen by GLM's grouped
sigmoid router plus shared experts (models/layers/moe.py); that one is the engine's `DecoderLM`.
Video is refused by name until GLM's per-frame timestamps land.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mm_engine.models.layers.decoder import DecoderLayer, DecoderLM, interleaved_pairs
from mm_engine.models.layers.glm_vision import GlmVisionTower
from mm_engine.models.layers.moe import checkpoint_layout, is_sparse
from mm_engine.models.qwen2_vl import Qwen2VLModel, QwenProcessing
from mm_engine.models.weights import materialize
from mm_engine.vision.video_io import FrameSampling, Video

NAMES = {"glm4v": "GLM-4.1V", "glm4v_moe": "GLM-4.5V", "glm46v": "GLM-4.6V", "glm_ocr": "GLM-OCR"}
# Parts of a fused gate_up_proj that split in half by output rows into gate_proj and up_proj.
_ROW_SPLIT = ("weight", "bias", "weight_scale", "weight_scale_inv")


def is_moe(text_config) -> bool:
    """GLM-4.5V's and GLM-4.6V's mixture-of-experts language model (`glm4v_moe_text`)."""
    return text_config.model_type == "glm4v_moe_text"


def head_dim(config) -> int:
    text = config.text_config
    if config.model_type == "glm_ocr" or is_moe(text):
        return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.hidden_size // text.num_attention_heads


def check_config(config) -> None:
    text = config.text_config
    stated = getattr(text, "head_dim", None)
    if config.model_type != "glm_ocr" and not is_moe(text) and stated not in (None, head_dim(config)):
        raise ValueError(f"text_config.head_dim {stated} differs from hidden_size / num_attention_heads, "
                         f"which {NAMES[config.model_type]} uses")  # fmt: skip
    if is_moe(text) and getattr(text, "use_qk_norm", False):
        raise ValueError("GLM mixture-of-experts models with use_qk_norm are not supported")
    turned = DecoderLM.rotary_dim(text, head_dim(config))
    section = (text.rope_parameters or {}).get("mrope_section")
    if not section or sum(section) != turned // 2:
        raise ValueError(f"rope_parameters.mrope_section {section} must cover the rotary half {turned // 2}")


class GlmProcessing(QwenProcessing):
    """Qwen's processing on the checkpoint's GLM image processor (its own resize rule)."""

    def video_sampling(self, overrides: Mapping[str, Any] | None = None) -> FrameSampling:
        raise ValueError(f"{NAMES.get(self.model_type, self.model_type)} video is not supported yet")

    def process_video(self, video: Video, overrides=None, group_tokens=None):
        raise ValueError(f"{NAMES.get(self.model_type, self.model_type)} video is not supported yet")


class GlmLM(DecoderLM):
    """The engine's decoder with GLM's layers (sandwich norms, the interleaved partial rotary)."""

    def make_layer(self, config, i, head_dim, bias, ops, qk_norm, tp, dtype) -> torch.nn.Module:
        pairs = interleaved_pairs(head_dim, self.rotary_dim(config, head_dim))
        sparse = is_sparse(config, i)
        return DecoderLayer(config, head_dim, bias, ops, qk_norm, tp, dtype, sparse, True, pairs)  # sandwich


def glm_lm_weights(state: dict, text_config) -> dict:
    """Drop layers past the config's (GLM-OCR's and GLM-4.5V's prediction layer); split each fused
    `mlp.gate_up_proj` into `gate_proj` (first half of its rows) and `up_proj`; stack a MoE
    model's per-expert tensors as the engine keeps them."""
    out = {}
    for key, ref in state.items():
        if key.startswith("layers.") and int(key.split(".")[1]) >= text_config.num_hidden_layers:
            continue
        if ".mlp.gate_up_proj." not in key:
            out[key] = ref
            continue
        head, part = key.split(".mlp.gate_up_proj.")
        if part not in _ROW_SPLIT:
            raise ValueError(f"{key!r}: a fused gate_up_proj stored as {part!r} is not supported")
        tensor = materialize({key: ref})[key]
        halves = (tensor, tensor) if tensor.numel() == 1 else tensor.chunk(2, dim=0)
        out[f"{head}.mlp.gate_proj.{part}"], out[f"{head}.mlp.up_proj.{part}"] = halves
    return checkpoint_layout(out, text_config) if is_moe(text_config) else out


class Glm4vModel(Qwen2VLModel):
    family = "GLM-4.1V"
    lm_class = GlmLM
    ocr = False  # GLM-OCR's tower

    @classmethod
    def language_model_class(cls, text_config) -> type[DecoderLM]:
        # The MoE decoder is a plain pre-norm one with a rotate_half partial rotary: the engine's own.
        return DecoderLM if is_moe(text_config) else GlmLM

    @staticmethod
    def lm_weights(state: dict, text_config) -> dict:
        return glm_lm_weights(state, text_config)

    @classmethod
    def build_tower(cls, config, ops) -> torch.nn.Module:
        return GlmVisionTower(config.vision_config, ops, cls.ocr)


class Glm46VModel(Glm4vModel):
    family = "GLM-4.6V"


class Glm4vMoeModel(Glm4vModel):
    family = "GLM-4.5V"


class GlmOcrModel(Glm4vModel):
    family = "GLM-OCR"
    ocr = True
