"""Qwen3-VL, dense (`Qwen3VLForConditionalGeneration`) and MoE (`Qwen3VLMoeForConditionalGeneration`).

Processing and positions are Qwen2-VL's (qwen2_vl.py), with two differences in the model: the
language model is Qwen3's (an RMSNorm over each head of q and k, no projection biases) with
*interleaved* M-RoPE (t h w t h w ... across a head's frequencies), and DeepStack: the tower also
hands out features from a few of its middle layers, each added to the output of one of the first
language-model layers at the image's positions. Those ride with each image's embeddings
(`[tokens, 1 + deepstack, hidden]`), so a prefill chunk that ends inside an image adds exactly
the rows it holds.
"""

from __future__ import annotations

import torch

from mm_engine.models.qwen2_vl import Qwen2VLModel, QwenProcessing, check_config

__all__ = ["Qwen3VLModel", "Qwen3VLMoeModel", "QwenProcessing", "check_config"]


class Qwen3VLModel(Qwen2VLModel):
    interleaved_mrope = True
    qk_norm = True
    family = "Qwen3-VL"

    def __init__(self, config, visual: torch.nn.Module, language_model) -> None:
        super().__init__(config, visual, language_model)
        self.num_deepstack = len(config.vision_config.deepstack_visual_indexes)
        if self.num_deepstack > len(language_model.layers):
            raise ValueError("more DeepStack feature layers than language-model layers")

    def _extras(self, out) -> list[torch.Tensor]:
        return list(out.deepstack_features)


class Qwen3VLMoeModel(Qwen3VLModel):
    """Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, Qwen3-VL-30B-A3B and 235B-A22B): the
    same model with mixture-of-experts feed-forward layers (models/layers/moe.py), which the
    decoder builds from the text config."""

    family = "Qwen3-VL-MoE"
