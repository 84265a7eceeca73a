"""The layout InternVL, Mistral 3 and Gemma 3 share: a vision tower of the engine's own, the
family's projector (transformers' class), the engine's language model, loaded from checkpoints
laid out LLaVA-style (`vision_tower.*`, `multi_modal_projector.*`, `language_model.*`,
`lm_head.*`). A family subclass builds its tower, names its projector and writes `encode`."""

from __future__ import annotations

from pathlib import Path

import torch

from mm_engine.models.interface import MultimodalModel
from mm_engine.models.platform import Platform
from mm_engine.models.weights import (
    build_language_model,
    load_strict,
    materialize,
    read_weights,
    ready,
    route_tower_projector_lm,
    split_by_prefix,
)
from mm_engine.parallel.group import TPGroup


class TowerProjectorModel(MultimodalModel):
    family = "?"
    # The part (vision, projector, lm) and name of each checkpoint key; a family with other
    # prefixes gives its own.
    route = staticmethod(route_tower_projector_lm)

    def __init__(self, config, vision_tower: torch.nn.Module, projector: torch.nn.Module, language_model):
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.language_model = language_model
        self.image_token_id = config.image_token_id

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(self.vision_tower.parameters()).dtype

    @staticmethod
    def projector_class():
        raise NotImplementedError

    @classmethod
    def build_tower(cls, state: dict, config, platform: Platform) -> torch.nn.Module:
        """The family's tower (float32, on the current default device) with the checkpoint's
        weights (`state`: the tower's part)."""
        raise NotImplementedError

    @classmethod
    def build_language_model(cls, lm_state: dict, config, dtype, device, platform: Platform, tp=None):
        return build_language_model(lm_state, config.text_config, dtype, device, platform.ops, tp=tp)

    @classmethod
    def from_checkpoint(
        cls, path: Path, config, dtype: torch.dtype, vision_dtype: torch.dtype, device: torch.device,
        platform: Platform, pack_weights: bool, tp: TPGroup | None = None,
    ) -> MultimodalModel:  # fmt: skip
        parts = split_by_prefix(read_weights(path), cls.route, cls.family)
        lm = cls.build_language_model(parts.get("lm", {}), config, dtype, device, platform, tp)
        with torch.device(device):
            tower = cls.build_tower(materialize(parts.get("vision", {})), config, platform)
        tower = tower.to(vision_dtype)
        projector = cls.projector_class()(config).to(device=device, dtype=dtype)  # in the LM's dtype
        load_strict(projector, parts.get("projector", {}), "projector")
        model = cls(config, tower, projector, lm)
        return ready(model, platform, pack_weights)
