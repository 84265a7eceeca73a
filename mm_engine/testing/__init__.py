"""Tiny random checkpoints of every supported family, laid out on disk as the published ones are
(config, safetensors, tokenizer, processor, chat template), for tests and benchmarks:

    from mm_engine.testing import build_checkpoint
    path = build_checkpoint("qwen2_5_vl", tmp_path / "q", text_dims={"num_hidden_layers": 4})

Nothing is downloaded; random weights generate arbitrary tokens. Each family's builder lives in a
module of its own; `**dims` are that builder's keyword arguments (`seed`, `text_dims`,
`vision_dims`, `vocab_size`, `weight_scale`, `dtype`, and the family's own)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# family -> (module, builder, the arguments the family's name fixes)
_BUILDERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llava": ("llava", "build_llava_checkpoint", {}),
    "llava_next": ("llava", "build_anyres_checkpoint", {"version": "llava_next"}),
    "llava_onevision": ("llava", "build_anyres_checkpoint", {"version": "llava_onevision"}),
    "qwen2_vl": ("qwen", "build_qwen_checkpoint", {"version": "qwen2_vl"}),
    "qwen2_5_vl": ("qwen", "build_qwen_checkpoint", {"version": "qwen2_5_vl"}),
    "qwen3_vl": ("qwen", "build_qwen_checkpoint", {"version": "qwen3_vl"}),
    "qwen3_vl_moe": ("qwen", "build_qwen_checkpoint", {"version": "qwen3_vl_moe"}),
    "qwen3_5": ("qwen", "build_qwen_checkpoint", {"version": "qwen3_5"}),
    "qwen3_5_moe": ("qwen", "build_qwen_checkpoint", {"version": "qwen3_5_moe"}),
    "idefics3": ("idefics", "build_idefics_checkpoint", {"version": "idefics3"}),
    "smolvlm": ("idefics", "build_idefics_checkpoint", {"version": "smolvlm"}),
    "internvl": ("internvl", "build_internvl_checkpoint", {"text": "qwen2"}),
    "internvl_qwen3": ("internvl", "build_internvl_checkpoint", {"text": "qwen3"}),
    "mistral3": ("mistral3", "build_mistral3_checkpoint", {}),
    "lighton_ocr": ("lighton_ocr", "build_lighton_ocr_checkpoint", {}),
    "gemma3": ("gemma3", "build_gemma3_checkpoint", {}),
    "gemma4": ("gemma4", "build_gemma4_checkpoint", {"version": "e"}),
    "gemma4_31b": ("gemma4", "build_gemma4_checkpoint", {"version": "large"}),
    "gemma4_moe": ("gemma4", "build_gemma4_checkpoint", {"version": "moe"}),
    "glm4v": ("glm", "build_glm_checkpoint", {"version": "glm4v"}),
    "glm46v": ("glm", "build_glm_checkpoint", {"version": "glm46v"}),
    "glm4v_moe": ("glm", "build_glm_checkpoint", {"version": "glm4v_moe"}),
    "glm_ocr": ("glm", "build_glm_checkpoint", {"version": "glm_ocr"}),
    "paddleocr_vl": ("paddleocr", "build_paddleocr_checkpoint", {}),
}
FAMILIES = tuple(_BUILDERS)


def build_checkpoint(family: str, path: str | Path, **dims: Any) -> Path:
    """A tiny random checkpoint of `family` (one of `FAMILIES`) saved in `path`."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    module, builder, fixed = _BUILDERS[family]
    clash = sorted(set(fixed) & set(dims))
    if clash:
        raise ValueError(f"{family!r} fixes {', '.join(clash)}; pass another family instead")
    build = getattr(importlib.import_module(f"mm_engine.testing.{module}"), builder)
    return Path(build(path, **fixed, **dims))


__all__ = ["FAMILIES", "build_checkpoint"]
