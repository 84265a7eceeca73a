"""Small random Idefics3 and SmolVLM checkpoints laid out as the published ones are (config,
safetensors, tokenizer with the row/column tokens, processor, chat template), for tests and
benchmarks. Nothing is downloaded; random weights generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import build_bytelevel_tokenizer, save_random_model, tiny_text, word_tokenizer

IDEFICS_SPECIAL = [
    "<|endoftext|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *[f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)],
]
IDEFICS_CHAT_TEMPLATE = (
    "<|endoftext|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'video' %}<video>"
    "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
VERSIONS = ("idefics3", "smolvlm")


def build_idefics_tokenizer(
    vocab_size: int | None = None, byte_level: bool = False
) -> PreTrainedTokenizerFast:
    names = dict(bos_token="<|endoftext|>", eos_token="<end_of_utterance>", pad_token="<|endoftext|>")
    if byte_level:  # as the published vocabularies are (SmolLM2's)
        return build_bytelevel_tokenizer(vocab_size, IDEFICS_SPECIAL, **names)
    fast = word_tokenizer(IDEFICS_SPECIAL, "User: Assistant:", vocab_size, **names)
    fast.add_tokens(["\n"])  # a token of its own, as in the real vocabularies
    return fast


def build_idefics_checkpoint(
    path: str | Path,
    version: str = "idefics3",
    tile: int = 32,
    longest_edge: int = 96,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
    byte_level: bool = False,
    scale_factor: int = 2,
) -> Path:
    """A random checkpoint of one of `VERSIONS`; tiny by default: 32-pixel tiles of 8-pixel
    patches, 4 tokens per tile after the 2x2 pixel shuffle, images resized to 96 pixels at most
    (up to 3x3 tiles plus the global one). `byte_level`: a byte-level BPE tokenizer instead of
    the word-level one (text the processor writes, such as SmolVLM2's frame times, spelled out).
    `scale_factor`: the connector's pixel shuffle (SmolVLM2: 4, a frame of 512 pixels is 64 tokens)."""
    from transformers import AutoConfig

    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    path = Path(path)
    tokenizer = build_idefics_tokenizer(vocab_size, byte_level)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in IDEFICS_SPECIAL}
    eos, pad = ids["<end_of_utterance>"], ids["<|endoftext|>"]
    text = tiny_text(len(tokenizer), eos, pad, pad, text_dims, model_type="llama")
    patch, scale = 8, scale_factor
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=tile,
        patch_size=patch,
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = AutoConfig.for_model(
        version, text_config=text, vision_config=vision, image_token_id=ids["<image>"], scale_factor=scale
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // scale**2
    sizes = dict(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": vision["image_size"]})
    if version == "smolvlm":
        from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

        processor = SmolVLMProcessor(
            image_processor=SmolVLMImageProcessor(**sizes),
            tokenizer=tokenizer,
            # SmolVLM2's: 1 frame a second, at most `max_frames`, each frame one square tile.
            video_processor=SmolVLMVideoProcessor(
                **sizes, video_sampling={"fps": 1, "max_frames": 8, "video_size": sizes["size"]}
            ),
            image_seq_len=seq_len,
            chat_template=IDEFICS_CHAT_TEMPLATE,
        )
    else:
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        processor = Idefics3Processor(
            image_processor=Idefics3ImageProcessor(**sizes),
            tokenizer=tokenizer,
            image_seq_len=seq_len,
            chat_template=IDEFICS_CHAT_TEMPLATE,
        )
    processor.save_pretrained(path)
    return path
