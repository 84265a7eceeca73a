"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`).

The processor resizes an image so its longest edge is `size.longest_edge`, then to multiples of
the tile size, and cuts it into `rows x cols` tiles plus the whole image shrunk to one tile (a
small image stays one tile). Each tile goes through a SigLIP-style tower; the connector's pixel
shuffle folds `scale_factor`^2 neighbouring patches into one token and projects it, so each tile
gives `image_seq_len` tokens. The prompt's `<image>` becomes, per tile,
`<fake_token_around_image><row_r_col_c>` + `<image>` x image_seq_len, a newline after each row,
then `\\n<fake_token_around_image><global-img>` + `<image>` x image_seq_len +
`<fake_token_around_image>`; only the `<image>` positions carry embeddings. The language model is
Llama's, with 1-D positions.

The tower is the engine's (layers/vit_tower.py: SigLIP with Idefics3's NaViT position buckets;
every tile is whole, since the processor pads no tile), the connector transformers' module; the
language model runs on the engine's paged layers.
Weights: `model.vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mm_engine.models.interface import MultimodalModel, ProcessedImage
from mm_engine.models.layers.vit_tower import VitTower, tower_state
from mm_engine.models.options import longest_edge
from mm_engine.models.platform import Platform
from mm_engine.models.smolvlm_video import SmolVLMVideo
from mm_engine.models.weights import (
    build_language_model,
    load_strict,
    materialize,
    read_weights,
    ready,
    split_by_prefix,
)
from mm_engine.parallel.group import TPGroup
from mm_engine.request import ImageSpan
from mm_engine.vision.image_io import image_content_hash

SUPPORTED_TEXT = ("llama", "mistral", "qwen2", "qwen3")


def check_config(config) -> None:
    if config.text_config.model_type not in SUPPORTED_TEXT:
        raise ValueError(
            f"unsupported language model {config.text_config.model_type!r}; supported: {SUPPORTED_TEXT}"
        )


class Idefics3Processing(SmolVLMVideo):
    """The checkpoint's own image processor (transformers'), one image per call, and the
    placeholder run built here from its rows and columns. Option: `longest_edge` (or vLLM's
    `size: {"longest_edge": N}`), the side the image is resized to before tiling. SmolVLM2's
    clips: models/smolvlm_video.py."""

    def __init__(self, path: Path, tokenizer, config, kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoProcessor

        hf = AutoProcessor.from_pretrained(path)
        self.hf = hf.image_processor
        self.tokenizer = tokenizer
        self.seq_len = hf.image_seq_len
        self.image_token = hf.image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(hf.image_token)
        self.fake = hf.fake_image_token
        self.global_tag = getattr(hf, "global_image_token", None) or hf.global_image_tag
        self.init_video(hf, kwargs)
        self.edge = longest_edge(self.hf.size.longest_edge, self.image_options(kwargs))
        self._salt = json.dumps(self.hf.to_dict(), sort_keys=True, default=str)
        self._runs: dict[tuple[int, int], tuple[list[int], tuple[bool, ...]]] = {}

    def run(self, rows: int, cols: int) -> tuple[list[int], tuple[bool, ...]]:
        """The token ids of one image's placeholder run, and which of them are `<image>`."""
        if (rows, cols) not in self._runs:
            image = self.image_token * self.seq_len
            glob = f"{self.fake}{self.global_tag}{image}{self.fake}"
            if rows == 0 and cols == 0:
                text = glob
            else:
                grid = "".join(
                    "".join(f"{self.fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                    for r in range(rows)
                )
                text = f"{grid}\n{glob}"
            # Every run starts and ends with a special token, so it tokenizes alike in any prompt.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._runs[rows, cols] = ids, tuple(t == self.image_token_id for t in ids)
        return self._runs[rows, cols]

    def process(self, image: Image.Image, overrides: Mapping[str, Any] | None = None) -> ProcessedImage:
        edge = longest_edge(self.edge, self.image_options(overrides))
        out = self.hf(
            images=[[image]], size={"longest_edge": edge}, return_row_col_info=True, return_tensors="pt"
        )
        pixels, mask = out["pixel_values"][0], out.get("pixel_attention_mask")
        if mask is not None and not bool(mask.all()):  # the engine's tower takes whole tiles only
            raise ValueError("the image processor padded inside a tile, which the vision tower does not take")
        ids, embed_mask = self.run(out["rows"][0][0], out["cols"][0][0])
        n = pixels.shape[0] * self.seq_len
        if sum(embed_mask) != n:
            raise ValueError(f"the placeholder run has {sum(embed_mask)} image tokens for {n} embeddings")
        digest = image_content_hash(image, f"{self._salt}|{edge}".encode())
        return ProcessedImage(pixels, ids, embed_mask, n, digest)


def _route(key: str) -> tuple[str, str] | None:
    k = key.removeprefix("model.")
    for prefix, part in (("vision_model.", "vision"), ("connector.", "connector"), ("text_model.", "lm")):
        if k.startswith(prefix):
            return part, k.removeprefix(prefix)
    if k.startswith("lm_head."):
        return "lm", k
    return None


class Idefics3Model(MultimodalModel):
    def __init__(self, config, vision_model: torch.nn.Module, connector: torch.nn.Module, language_model):
        super().__init__()
        self.config = config
        self.vision_model = vision_model
        self.connector = connector
        self.language_model = language_model
        self.image_token_id = config.image_token_id

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(self.vision_model.parameters()).dtype

    @torch.inference_mode()
    def encode(self, images: list[ImageSpan]) -> list[torch.Tensor]:
        device = self.language_model.embed_tokens.weight.device
        pixels = torch.cat([span.pixel_values for span in images]).to(device, self.vision_dtype)
        (hidden,) = self.vision_model(pixels)
        lm_dtype = self.language_model.embed_tokens.weight.dtype
        feats = self.connector(hidden.to(lm_dtype))  # [tiles, image_seq_len, hidden]
        feats = feats.reshape(-1, 1, feats.shape[-1])
        return list(feats.split([span.num_embeds for span in images]))

    @classmethod
    def from_checkpoint(
        cls, path: Path, config, dtype: torch.dtype, vision_dtype: torch.dtype, device: torch.device,
        platform: Platform, pack_weights: bool, tp: TPGroup | None = None,
    ) -> MultimodalModel:  # fmt: skip
        if config.model_type == "smolvlm":
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector as connector_cls
        else:
            from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector as connector_cls
        parts = split_by_prefix(read_weights(path), _route, config.model_type)
        lm = build_language_model(parts.get("lm", {}), config.text_config, dtype, device, platform.ops, tp=tp)
        depth = config.vision_config.num_hidden_layers
        with torch.device(device):
            tower = VitTower(config.vision_config, [depth], platform.ops, post_norm=True)
        state = tower_state(materialize(parts.get("vision", {})), depth, "navit", post_norm=True)
        load_strict(tower, state, "vision tower")
        tower = tower.to(vision_dtype)
        connector = connector_cls(config).to(device=device, dtype=dtype)  # in the LM's dtype
        load_strict(connector, parts.get("connector", {}), "connector")
        model = cls(config, tower, connector, lm)
        return ready(model, platform, pack_weights)
