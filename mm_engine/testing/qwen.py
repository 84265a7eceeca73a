"""Small random Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE checkpoints
laid out as the published ones are (config, safetensors, tokenizer, processor with its image and
video processors, chat template), for tests and benchmarks. Nothing is downloaded; random weights
generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import build_bytelevel_tokenizer, save_random_model, tiny_text, word_tokenizer

QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen's shape, smaller: with `tools` a system turn lists them and asks for Hermes-style calls; an
# assistant turn's calls are written back as such, a tool's answer as a user turn.
QWEN_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system You may call functions. <tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> To call one, answer "
    '<tool_call>{"name": name, "arguments": arguments}</tool_call><|im_end|> {% endif %}'
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user <tool_response>{{ message['content'] }}"
    "</tool_response><|im_end|> {% else %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|> {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
VERSIONS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Qwen3.5-MoE's experts: as Qwen3-VL-MoE's, plus a shared expert of width 48 (every layer sparse).
MOE_35_TEXT = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)
# Qwen3.5's hybrid layers, tiny: linear attention (GQA-style 2 key heads for 4 value heads) around
# one gated full-attention layer, the rotary over half of each head.
HYBRID_TEXT = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)  # fmt: skip
# Qwen3-VL-MoE's experts, tiny: 4 of width 32, 2 per token, every layer sparse.
MOE_TEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)


def build_qwen_tokenizer(vocab_size: int | None = None, byte_level: bool = False) -> PreTrainedTokenizerFast:
    names = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if byte_level:
        return build_bytelevel_tokenizer(vocab_size, QWEN_SPECIAL, **names)
    return word_tokenizer(QWEN_SPECIAL, "user assistant system", vocab_size, **names)


def build_qwen_checkpoint(
    path: str | Path,
    version: str = "qwen2_vl",
    patch_size: int = 8,
    min_pixels: int = 16 * 16 * 2,
    max_pixels: int = 16 * 16 * 48,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
    byte_level: bool = False,
) -> Path:
    """A random checkpoint of one of `VERSIONS`; tiny by default (head size 32, GQA 4:2, two
    layers, an 8-pixel patch, images of 2 to 48 merged tokens). `byte_level`: a byte-level BPE
    tokenizer, which can spell JSON (structured output, tool calls)."""
    from transformers import AutoConfig

    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    path = Path(path)
    tokenizer = build_qwen_tokenizer(vocab_size, byte_level)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    text = tiny_text(
        len(tokenizer), eos, pad, None, text_dims, max_position_embeddings=512, rms_norm_eps=1e-6
    )
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    half = head_dim // 2
    section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]  # 16 -> [4, 6, 6]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    merge = 2
    vision = dict(patch_size=patch_size, spatial_merge_size=merge, temporal_patch_size=2)
    if version == "qwen2_vl":
        vision.update(depth=2, embed_dim=64, hidden_size=text["hidden_size"], num_heads=2)
    elif version == "qwen2_5_vl":
        # Windows of 2x2 merged tokens, the middle layer attending to the whole image.
        vision.update(
            depth=3, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"],
            window_size=patch_size * merge * 2, fullatt_block_indexes=[1],
        )  # fmt: skip
    else:
        if version == "qwen3_vl_moe":
            text.update({**MOE_TEXT, **(text_dims or {})})
        if version in ("qwen3_5", "qwen3_5_moe"):
            moe = MOE_35_TEXT if version == "qwen3_5_moe" else {}
            text.update({**HYBRID_TEXT, **moe, **(text_dims or {})})
            factor = text.pop("partial_rotary_factor", 0.5)  # Qwen3.5's own is 0.25 of 256
            rope["partial_rotary_factor"] = factor
            half = int(head_dim * factor) // 2
        rope.update(
            mrope_interleaved=True,
            mrope_section=[half - 2 * (5 * half // 16), 5 * half // 16, 5 * half // 16],
        )
        text.update(head_dim=head_dim)
        vision.update(
            depth=3, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"],
            num_position_embeddings=64,
        )  # fmt: skip
        if not version.startswith("qwen3_5"):
            vision["deepstack_visual_indexes"] = [0, 1]
    vision.update(vision_dims or {})
    text["rope_parameters"] = rope
    cfg = AutoConfig.for_model(
        version,
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,  # a tied head mostly repeats the last token of a random model
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    _save_processor(path, version, tokenizer, patch_size, merge, min_pixels, max_pixels)
    return path


def _save_processor(path, version, tokenizer, patch_size, merge, min_pixels, max_pixels) -> None:
    from transformers import Qwen2VLImageProcessor

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image = Qwen2VLImageProcessor(patch_size=patch_size, merge_size=merge, temporal_patch_size=2, size=size)
    if version in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        from transformers import Qwen3VLProcessor as Processor
        from transformers import Qwen3VLVideoProcessor as Video
    else:
        from transformers import Qwen2VLProcessor as Processor
        from transformers import Qwen2VLVideoProcessor as Video
    if version == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor as Processor
    video = Video(patch_size=patch_size, merge_size=merge, temporal_patch_size=2, size=size)
    Processor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=QWEN_CHAT_TEMPLATE
    ).save_pretrained(path)


def reference_tower_class(model_type: str):
    """transformers' vision tower of a Qwen version (by the model's `model_type`): the reference
    the engine's own tower is held to in tests and bench.towers."""
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel
    if model_type == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel
    if model_type == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel
    if model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        return Qwen3VLMoeVisionModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel
