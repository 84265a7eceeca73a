"""Small random LightOnOCR checkpoints (a Pixtral tower, Mistral 3's projector without biases, a
Qwen3 language model) laid out as the published ones are (config, safetensors, tokenizer naming
its image tokens, processor, chat template), for tests and benchmarks. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

LIGHTON_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_pad|>",
                   "<|vision_end|>"]  # fmt: skip
LIGHTON_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image_pad|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def build_lighton_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    names = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
             "image_end_token": "<|vision_end|>"}  # fmt: skip
    return word_tokenizer(
        LIGHTON_SPECIAL, "user assistant system", vocab_size, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=names,
    )  # fmt: skip


def build_lighton_ocr_checkpoint(
    path: str | Path,
    patch_size: int = 8,
    longest_edge: int = 96,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random checkpoint, tiny by default: 8-pixel patches merged 2x2 (one token per 16 px each
    way), pages resized to at most 96 px, a Qwen3 LM (q/k norms, GQA 4:2, head size 32), the head
    tied to the embeddings as published."""
    from transformers import LightOnOcrConfig, LightOnOcrProcessor, PixtralImageProcessor

    path = Path(path)
    tokenizer = build_lighton_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LIGHTON_SPECIAL}
    text = tiny_text(
        len(tokenizer), ids["<|im_end|>"], ids["<|endoftext|>"], None, text_dims,
        model_type="qwen3", head_dim=32, sliding_window=None, tie_word_embeddings=True,
    )  # fmt: skip
    vision = dict(
        model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, head_dim=32, patch_size=patch_size, image_size=longest_edge,
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = LightOnOcrConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], spatial_merge_size=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    save_random_model(cfg, path, seed, weight_scale, dtype)
    # The image processor resizes to whole merged tokens (patch x merge), as the published one does.
    image = PixtralImageProcessor(size={"longest_edge": longest_edge}, patch_size=patch_size * 2)
    LightOnOcrProcessor(
        image_processor=image, tokenizer=tokenizer, patch_size=patch_size, spatial_merge_size=2,
        chat_template=LIGHTON_CHAT_TEMPLATE,
    ).save_pretrained(path)  # fmt: skip
    return path
