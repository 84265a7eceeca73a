"""A LLaVA model: vision tower -> MLP projector -> decoder LM, with image features spliced into the
token embeddings at the image-token positions.

The vision tower is transformers' own CLIP or SigLIP vision model (an encoder that needs no paged
cache), cut after the deepest layer LLaVA reads, and may run in its own dtype (float16 on CUDA).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.layers import DecoderLM
from mm_engine.packed_linear import PackedLinear


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)

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


class LlavaModel(nn.Module):
    def __init__(
        self, config, vision_tower: nn.Module, language_model: DecoderLM, projector_bias: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.layers = feature_layers(config)
        self.vision_tower = vision_tower
        self.vision_tower.encoder.layers = self.vision_tower.encoder.layers[: max(self.layers)]
        for module in self.vision_tower.modules():
            if getattr(module, "use_head", False):
                # SigLIP's attention-pooling head makes a pooled vector that LLaVA never reads.
                module.use_head = False
        in_dim = config.vision_config.hidden_size * len(self.layers)
        self.multi_modal_projector = Projector(
            in_dim, config.text_config.hidden_size, config.projector_hidden_act, projector_bias
        )
        self.language_model = language_model
        self.image_token_id = config.image_token_index
        self.tokens_per_image = tokens_per_image(config)

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(self.vision_tower.parameters()).dtype

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_image, text hidden size] in the LM's dtype."""
        out = self.vision_tower(pixel_values.to(self.vision_dtype), output_hidden_states=True)
        feats = [out.hidden_states[i] for i in self.layers]
        if self.config.vision_feature_select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        feats = torch.cat(feats, dim=-1)
        return self.multi_modal_projector(feats.to(self.multi_modal_projector.dtype))
