"""LightOnOCR (`LightOnOcrForConditionalGeneration`: LightOnOCR-1B, LightOnOCR-2): Mistral 3's
image path (mistral3.py) on a document page, a Qwen3 language model.

What differs from Mistral 3: the page's merged tokens are `<|image_pad|>` x rows x columns with no
break or end tokens (the processor's `replace_image_token`); the tower's last hidden state feeds
the projector (norm, 2x2 patch merger, two bias-free linears around a GELU); the image processor
resizes to whole merged tokens by its own `patch_size`, which the engine leaves as it is; the
language model is Qwen3's (q/k norms, 1-D positions), its head tied to the embeddings.
Weights: `model.vision_encoder.*`, `model.vision_projection.*`, `model.language_model.*` (and
`lm_head.*` when untied).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from PIL import Image

from mm_engine.models import mistral3
from mm_engine.models.interface import ProcessedImage
from mm_engine.models.layers.pixtral_tower import PixtralTower, pixtral_state
from mm_engine.models.mistral3 import Mistral3Model, PixtralProcessing
from mm_engine.models.options import longest_edge
from mm_engine.models.platform import Platform
from mm_engine.models.weights import load_strict, route_tower_projector_lm
from mm_engine.vision.image_io import image_content_hash

check_config = functools.partial(mistral3.check_config, supported=("qwen3",))


class LightOnOcrProcessing(PixtralProcessing):
    """The checkpoint's Pixtral image processor at its own patch size; image tokens only."""

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        edge = longest_edge(self.edge, overrides)
        out = self.hf(images=[image], size={"longest_edge": edge}, return_tensors="pt")
        height, width = (int(v) for v in out["image_sizes"][0])
        n = (height // self.step) * (width // self.step)
        pixels = out["pixel_values"][0][:, :height, :width]
        digest = image_content_hash(image, f"{self._salt}|{edge}".encode())
        return ProcessedImage(pixels, [self.image_token_id] * n, None, n, digest, grid=(height, width))


class LightOnOcrModel(Mistral3Model):
    family = "LightOnOCR"
    route = staticmethod(functools.partial(route_tower_projector_lm, tower="vision_encoder.",
                                           projector="vision_projection."))  # fmt: skip

    @staticmethod
    def projector_class():
        from transformers.models.lighton_ocr.modeling_lighton_ocr import LightOnOcrMultiModalProjector

        return LightOnOcrMultiModalProjector

    @classmethod
    def build_tower(cls, state: dict, config, platform: Platform) -> PixtralTower:
        depth = config.vision_config.num_hidden_layers  # the last hidden state
        tower = PixtralTower(config.vision_config, [depth], platform.ops)
        load_strict(tower, pixtral_state(state, depth), "vision tower")
        tower.fuse()
        return tower
