"""Small random InternVL checkpoints in transformers' format (config, safetensors, tokenizer with
`<img>`, `</img>` and `<IMG_CONTEXT>`, processor, chat template), for tests and benchmarks.
Nothing is downloaded; random weights generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

INTERNVL_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
]
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def build_internvl_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    return word_tokenizer(
        INTERNVL_SPECIAL,
        "user assistant system",
        vocab_size,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )


def build_internvl_checkpoint(
    path: str | Path,
    tile: int = 32,
    max_patches: int = 6,
    text: str = "qwen2",
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random checkpoint, tiny by default: 32-pixel tiles of 8-pixel patches (4 tokens per tile
    after the pixel shuffle), 1 to 6 tiles plus a thumbnail, a Qwen2 language model (GQA 4:2), or
    with `text="qwen3"` a Qwen3 one (q/k norms: InternVL3.5)."""
    from transformers import (
        AutoConfig,
        GotOcr2ImageProcessor,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    path = Path(path)
    tokenizer = build_internvl_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in INTERNVL_SPECIAL}
    family = {"model_type": text, **({"head_dim": 32} if text == "qwen3" else {})}
    text = tiny_text(len(tokenizer), ids["<|im_end|>"], ids["<|endoftext|>"], None, text_dims, **family)
    patch = 8
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=[tile, tile], patch_size=[patch, patch],
    )  # fmt: skip
    vision.update(vision_dims or {})
    seq_len = (tile // patch) ** 2 // 4
    cfg = AutoConfig.for_model(
        "internvl",
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=seq_len,
        downsample_ratio=0.5,
        tie_word_embeddings=False,  # a tied head mostly repeats the last token of a random model
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    image = GotOcr2ImageProcessor(
        size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=max_patches
    )
    InternVLProcessor(
        image_processor=image,
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size={"height": tile, "width": tile}),
        image_seq_length=seq_len,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    ).save_pretrained(path)
    return path
