"""Small random PaddleOCR-VL checkpoints laid out as the published one is (config, safetensors,
tokenizer naming its image token, processor, chat template), for tests and benchmarks. Nothing is
downloaded; random weights generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

PADDLE_SPECIAL = [
    "<unk_pad>", "<s>", "</s>", "<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>", "<|video_pad|>",
]  # fmt: skip
PADDLE_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)


def build_paddleocr_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    return word_tokenizer(
        PADDLE_SPECIAL, "User Assistant OCR:", vocab_size, bos_token="<s>", eos_token="</s>",
        pad_token="<unk_pad>", extra_special_tokens={"image_token": "<|IMAGE_PLACEHOLDER|>"},
    )  # fmt: skip


def build_paddleocr_checkpoint(
    path: str | Path,
    patch_size: int = 8,
    min_pixels: int = 16 * 16 * 4,
    max_pixels: int = 16 * 16 * 48,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random checkpoint, tiny by default: a two-block tower of 8-px patches with a 4 x 4
    position square (resized to every grid), 2x2 merged; images of 4 to 48 tokens; an ERNIE-4.5
    language model of two layers with M-RoPE over head size 32."""
    from transformers import AutoConfig
    from transformers.models.paddleocr_vl import PaddleOCRVLImageProcessor, PaddleOCRVLProcessor

    path = Path(path)
    tokenizer = build_paddleocr_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in PADDLE_SPECIAL}
    text = tiny_text(
        len(tokenizer), ids["</s>"], ids["<unk_pad>"], ids["<s>"], text_dims, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [4, 6, 6]},
    )  # fmt: skip
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        patch_size=patch_size, image_size=4 * patch_size,
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = AutoConfig.for_model(
        "paddleocr_vl", text_config=text, vision_config=vision, image_token_id=ids["<|IMAGE_PLACEHOLDER|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|IMAGE_START|>"],
        vision_end_token_id=ids["<|IMAGE_END|>"],
    )  # fmt: skip
    save_random_model(cfg, path, seed, weight_scale, dtype)
    image = PaddleOCRVLImageProcessor(
        patch_size=patch_size, size={"shortest_edge": min_pixels, "longest_edge": max_pixels}
    )
    PaddleOCRVLProcessor(
        image_processor=image, tokenizer=tokenizer, chat_template=PADDLE_CHAT_TEMPLATE
    ).save_pretrained(path)
    return path
