"""Small random Gemma 3 checkpoints laid out as the published ones are (config, safetensors,
tokenizer with `<start_of_image>`, `<image_soft_token>`, `<end_of_image>`, processor, chat
template), for tests and benchmarks. Nothing is downloaded; random weights generate arbitrary
tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

GEMMA3_SPECIAL = [
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
    "<image_soft_token>",
]  # fmt: skip
GEMMA3_CHAT_TEMPLATE = (
    "<bos>{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_gemma3_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    fast = word_tokenizer(
        GEMMA3_SPECIAL, "user model", vocab_size, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )  # fmt: skip
    fast.add_tokens(["\n"])  # a token of its own, as in the real vocabulary
    return fast


def build_gemma3_checkpoint(
    path: str | Path,
    sliding_window: int = 24,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random checkpoint, tiny by default: a 32-px SigLIP tower of 8-px patches pooled to 4
    tokens an image, a Gemma 3 LM of 4 layers (3 sliding-window layers of 24 tokens, then a
    global one; head size 32, GQA 4:2)."""
    from transformers import AutoConfig, Gemma3ImageProcessor, Gemma3Processor

    path = Path(path)
    tokenizer = build_gemma3_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL}
    text = tiny_text(
        len(tokenizer), ids["<eos>"], ids["<pad>"], ids["<bos>"], text_dims,
        num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )  # fmt: skip
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        patch_size=8, vision_use_head=False,
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = AutoConfig.for_model(
        "gemma3",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    image = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    Gemma3Processor(
        image_processor=image, tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA3_CHAT_TEMPLATE
    ).save_pretrained(path)
    return path
