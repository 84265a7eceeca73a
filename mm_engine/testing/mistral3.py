"""Small random Mistral 3 (Pixtral tower) checkpoints laid out as the published ones are (config,
safetensors, tokenizer with `[IMG]`, `[IMG_BREAK]`, `[IMG_END]`, processor, chat template), for
tests and benchmarks. Nothing is downloaded; random weights generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

MISTRAL3_SPECIAL = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}"
)


def build_mistral3_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    return word_tokenizer(
        MISTRAL3_SPECIAL, "user assistant", vocab_size, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_mistral3_checkpoint(
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
    way), images resized to at most 96 px (up to 6 x 6 tokens plus breaks), a Mistral LM (GQA 4:2,
    head size 32)."""
    from transformers import AutoConfig, PixtralImageProcessor, PixtralProcessor

    path = Path(path)
    tokenizer = build_mistral3_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in MISTRAL3_SPECIAL}
    text = tiny_text(
        len(tokenizer), ids["</s>"], ids["<pad>"], ids["<s>"], text_dims,
        model_type="mistral", head_dim=32, sliding_window=None,
    )  # fmt: skip
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
        patch_size=patch_size, image_size=longest_edge,
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = AutoConfig.for_model(
        "mistral3",
        text_config=text,
        vision_config=vision,
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    image = PixtralImageProcessor(size={"longest_edge": longest_edge}, patch_size=patch_size)
    PixtralProcessor(
        image_processor=image,
        tokenizer=tokenizer,
        patch_size=patch_size,
        spatial_merge_size=2,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    ).save_pretrained(path)
    return path
