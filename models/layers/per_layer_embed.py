"""Per-layer input embeddings (PLE: Gemma 4's E2B and E4B): beside the usual embedding, every
token gets a small vector for each decoder layer, which that layer gates into its residual stream
after the MLP.

The vector of layer `l` is the mean (scaled by 1/sqrt(2)) of two parts:
- a lookup of the token in a second, packed table `[vocab, layers x width]` (scaled by
  sqrt(width)); the caller maps an image's placeholder tokens to the pad token first;
- a projection of the token's input embedding (the image's own, for image rows) to
  `layers x width`, scaled by 1/sqrt(hidden) and RMS-normed per layer.

In a layer (`PerLayerGate`): the residual stream, projected to the width, activated, times the
layer's vector, projected back and normed, is added to the stream.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from mm_engine.kernels.ops import TorchOps
from mm_engine.models.layers.decoder import RMSNorm
from mm_engine.models.layers.gemma import ScaledEmbedding


class PerLayerEmbedding(nn.Module):
    """`forward(token_ids, embeds)` -> `[tokens, layers, width]`. Parameter names are the
    checkpoint's, under `per_layer.` (models/gemma4.py renames the three keys)."""

    def __init__(self, config, ops: TorchOps, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.layers, self.width = config.num_hidden_layers, config.hidden_size_per_layer_input
        hidden, packed = config.hidden_size, self.layers * self.width
        self.embed_tokens_per_layer = ScaledEmbedding(
            config.vocab_size_per_layer_input, packed, self.width**0.5, dtype
        )
        self.per_layer_model_projection = nn.Linear(hidden, packed, bias=False, dtype=dtype)
        self.per_layer_projection_norm = RMSNorm(self.width, config.rms_norm_eps, ops, dtype)
        self.projection_scale = hidden**-0.5

    def forward(self, token_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        t = token_ids.shape[0]
        lookup = self.embed_tokens_per_layer(token_ids).view(t, self.layers, self.width)
        projected = self.per_layer_model_projection(embeds) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.reshape(t * self.layers, self.width))
        return (projected.view(t, self.layers, self.width) + lookup) * 2**-0.5


class PerLayerGate(nn.Module):
    """A decoder layer's use of its vector; owned by the layer under the checkpoint's names."""

    def __init__(self, config, ops: TorchOps, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hidden, width = config.hidden_size, config.hidden_size_per_layer_input
        self.per_layer_input_gate = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.per_layer_projection = nn.Linear(width, hidden, bias=False, dtype=dtype)
        self.post_per_layer_input_norm = RMSNorm(hidden, config.rms_norm_eps, ops, dtype)
        self.act = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        gated = self.act(self.per_layer_input_gate(x)) * vector
        return x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
