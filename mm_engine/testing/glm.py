"""Small random GLM-4.1V, GLM-4.6V and GLM-OCR checkpoints laid out as the published ones are
(config, safetensors, tokenizer naming its image and video tokens, processor, chat template), for
tests and benchmarks. Nothing is downloaded; random weights generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

GLM_SPECIAL = [
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|begin_of_image|>",
    "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>",
]  # fmt: skip
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|> "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
VERSIONS = ("glm4v", "glm46v", "glm_ocr", "glm4v_moe")
# GLM-4.5V's mixture of experts, tiny: layer 0 dense, then 4 experts in 2 groups (the best group
# kept, top 2 in it) plus one shared expert, each of width 32.
MOE_TEXT = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    norm_topk_prob=True,
    num_hidden_layers=3,
    attention_bias=True,
    head_dim=32,
)


def build_glm_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    names = {"image_token": "<|image|>", "video_token": "<|video|>"}
    return word_tokenizer(
        GLM_SPECIAL, "user assistant system", vocab_size, eos_token="<|user|>", pad_token="<|endoftext|>",
        extra_special_tokens=names,
    )  # fmt: skip


def build_glm_checkpoint(
    path: str | Path,
    version: str = "glm4v",
    patch_size: int = 8,
    min_pixels: int = 16 * 16 * 4,
    max_pixels: int = 16 * 16 * 96,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random checkpoint of one of `VERSIONS`, tiny by default: head size 32 with the rotary over
    half of it (as published), GQA 4:2, two layers, an 8-pixel patch merged 2x2, images of 2 to
    48 merged tokens (GLM's processor counts an image as two frames against `max_pixels`).
    GLM-OCR's text config names a head size of its own (48 here)."""
    from transformers import AutoConfig

    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    path = Path(path)
    tokenizer = build_glm_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM_SPECIAL}
    text_type = f"{version}_text" if version != "glm46v" else "glm4v_text"
    family = {**(MOE_TEXT if version == "glm4v_moe" else {}), **(text_dims or {})}
    text = tiny_text(len(tokenizer), ids["<|user|>"], ids["<|endoftext|>"], None, family,
                     rms_norm_eps=1e-5, model_type=text_type)  # fmt: skip
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    if version == "glm_ocr":
        head_dim = text.setdefault("head_dim", 48)
    quarter = head_dim // 4  # the rotary's frequencies: half a head turns, in pairs
    section = [quarter - 2 * (3 * quarter // 8), 3 * quarter // 8, 3 * quarter // 8]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": section}  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=text["hidden_size"],
        patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2, image_size=patch_size * 6,
        rms_norm_eps=1e-5, attention_bias=True, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = AutoConfig.for_model(
        version, text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=False,
    )  # fmt: skip
    save_random_model(cfg, path, seed, weight_scale, dtype, _spread_routers)
    if version == "glm_ocr":
        _save_prediction_layer(path, text, seed)
    _save_processor(path, version, tokenizer, patch_size, min_pixels, max_pixels)
    return path


def _spread_routers(model) -> None:
    """GLM-4.5V's router starts at zero (every expert's score 1/2, all tied): random weights, and a
    score correction that moves some choices."""
    with torch.no_grad():
        for name, value in (*model.named_parameters(), *model.named_buffers()):
            if name.endswith("mlp.gate.weight"):
                value.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                value.normal_(0.0, 0.2)


def _save_prediction_layer(path: Path, text: dict, seed: int) -> None:
    """GLM-OCR's published checkpoints carry a multi-token-prediction layer after the last decoder
    layer; a file of its own here (transformers reads only the model's file and ignores it)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    prefix = f"model.language_model.layers.{text['num_hidden_layers']}"
    dim = text["hidden_size"]
    save_file({f"{prefix}.eh_proj.weight": torch.randn(dim, 2 * dim, generator=g),
               f"{prefix}.enorm.weight": torch.ones(dim)}, path / "mtp.safetensors")  # fmt: skip


def _save_processor(path, version, tokenizer, patch_size, min_pixels, max_pixels) -> None:
    if version == "glm46v":
        from transformers import Glm46VImageProcessor as Image
        from transformers import Glm46VProcessor as Processor
        from transformers import Glm46VVideoProcessor as Video
    else:
        from transformers import Glm4vImageProcessor as Image
        from transformers import Glm4vProcessor as Processor
        from transformers import Glm4vVideoProcessor as Video
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image = Image(patch_size=patch_size, merge_size=2, temporal_patch_size=2, size=size)
    video = Video(patch_size=patch_size, merge_size=2, temporal_patch_size=2, size=size)
    Processor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=GLM_CHAT_TEMPLATE
    ).save_pretrained(path)
