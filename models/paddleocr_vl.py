"""PaddleOCR-VL (`PaddleOCRVLForConditionalGeneration`): document OCR on the Qwen2-VL line's path.

The processor resizes a page within min/max pixels to multiples of 28 px and cuts 14-px patches in
raster order; the tower (layers/paddle_vision.py: a NaViT-style SigLIP with a 2-D rotary) and its
projector merge every 2 x 2 patches into one token; the prompt's image placeholder becomes one
token per merged patch, all embeddings. The language model is ERNIE-4.5's (Llama-shaped) with
M-RoPE positions over the merged grid, as Qwen2-VL's (mrope.py); the engine's paged `DecoderLM`
runs it. Weights as published: `visual.vision_model.*`, `mlp_AR.*` (the projector), `model.*` (the
language model; `lm_head` tied), or as transformers lays the modules out (`model.visual.*`,
`model.projector.*`, `model.language_model.*`). Video is refused by name.
"""

from __future__ import annotations

import torch

from mm_engine.models.layers.paddle_vision import PaddleVisionTower
from mm_engine.models.qwen2_vl import Qwen2VLModel, QwenProcessing
from mm_engine.models.qwen2_vl import check_config as check_mrope

PaddleOCRProcessing = QwenProcessing  # the checkpoint's own processor, min/max pixels as Qwen's


def check_config(config) -> None:
    if config.text_config.model_type != "paddleocr_vl_text":
        raise ValueError(f"unsupported language model {config.text_config.model_type!r} for PaddleOCR-VL")
    check_mrope(config)


class PaddleOCRVLModel(Qwen2VLModel):
    family = "PaddleOCR-VL"

    @staticmethod
    def route(key: str) -> tuple[str, str] | None:
        if key.startswith("mlp_AR."):  # the projector, as published (and as transformers saves it)
            return "vision", "projector." + key.removeprefix("mlp_AR.")
        k = key.removeprefix("model.")
        if k.startswith(("visual.", "projector.")):
            return "vision", k.removeprefix("visual.")
        if k.startswith("lm_head."):
            return "lm", k
        k = k.removeprefix("language_model.")
        return ("lm", k) if k.split(".")[0] in ("embed_tokens", "layers", "norm") else None

    @staticmethod
    def build_tower(config, ops) -> torch.nn.Module:
        return PaddleVisionTower(config, ops)
