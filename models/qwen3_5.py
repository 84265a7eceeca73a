"""Qwen3.5 and Qwen3.6, dense (`Qwen3_5ForConditionalGeneration`; MiniCPM-V 4.6's language model
too) and MoE (`Qwen3_5MoeForConditionalGeneration`):
natively multimodal, with a hybrid language model (models/layers/hybrid.py: Gated DeltaNet
layers interleaved with gated full attention) whose linear layers keep their state in the state
pool instead of KV blocks.

Images are processed and placed as in Qwen3-VL (the Qwen2-VL processor, interleaved M-RoPE over
the rotary part of each head), without DeepStack; the tower is the engine's (qwen_vision.py).
Checkpoints store the RMSNorms' weights as offsets from 1 (`x * (1 + w)`); they are shifted on
load. The multi-token-prediction head some checkpoints carry (`mtp.*`) is not used.
"""

from __future__ import annotations

from mm_engine.models.layers.hybrid import HybridLM, is_hybrid
from mm_engine.models.qwen2_vl import Qwen2VLModel, QwenProcessing, _route
from mm_engine.models.weights import materialize

__all__ = ["Qwen3_5Model", "Qwen3_5MoeModel", "QwenProcessing", "check_config"]

# Norms stored as offsets from 1 (the gated norm inside a linear layer is not one of them).
_SHIFTED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def check_config(config) -> None:
    text = config.text_config
    if not is_hybrid(text):
        raise ValueError("a Qwen3.5 config without linear-attention layers (text_config.layer_types)")
    section = (text.rope_parameters or {}).get("mrope_section")
    turned = HybridLM.rotary_dim(text, text.head_dim)
    if not section or sum(section) != turned // 2:
        raise ValueError(f"rope_parameters.mrope_section {section} must cover the rotary half {turned // 2}")


class Qwen3_5Model(Qwen2VLModel):
    interleaved_mrope = True
    qk_norm = True
    family = "Qwen3.5"
    lm_class = HybridLM

    @staticmethod
    def route(key: str) -> tuple[str, str] | None:
        return ("unused", key) if key.startswith("mtp.") else _route(key)

    @staticmethod
    def lm_weights(state: dict, text_config) -> dict:
        """`1 + w` for every norm stored as an offset (in float32, as the reference computes it)."""
        out = dict(state)
        for key in state:
            if key.endswith(_SHIFTED) or key == "norm.weight":
                tensor = materialize({key: state[key]})[key]
                out[key] = (1.0 + tensor.float()).to(tensor.dtype)
        return out


class Qwen3_5MoeModel(Qwen3_5Model):
    """Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, Qwen3.5-35B-A3B to 397B-A17B): the same
    model with a mixture of experts plus a gated shared expert in every layer (models/layers/moe.py)."""

    family = "Qwen3.5-MoE"
