"""Small random LLaVA checkpoints the way a user's real one looks on disk: a CLIP or SigLIP tower,
a Llama or Qwen2 language model and a `LlavaProcessor` with a chat template; and LLaVA-NeXT /
LLaVA-OneVision ones with any-resolution tiles. Random weights generate arbitrary tokens."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaProcessor,
    Qwen2Config,
    SiglipImageProcessor,
    SiglipVisionConfig,
)

from mm_engine.testing.common import (
    CHAT_TEMPLATE,
    build_bytelevel_tokenizer,
    build_tokenizer,
    save_random_model,
)


def build_llava_checkpoint(
    path: str | Path,
    vision: str = "clip",
    text: str = "llama",
    image_size: int = 32,
    patch_size: int = 8,
    seed: int = 0,
    select_strategy: str = "default",
    feature_layer: int | list[int] = -2,
    vision_dims: dict | None = None,
    text_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
    byte_level: bool = False,
) -> Path:
    """A random LLaVA checkpoint; tiny by default. `vision_dims` / `text_dims` override the towers'
    sizes (hidden_size, intermediate_size, num_hidden_layers, heads, ...) for benchmark models.
    `byte_level`: a byte-level BPE tokenizer instead of the word-level one (structured output)."""
    path = Path(path)
    tokenizer = build_bytelevel_tokenizer(vocab_size) if byte_level else build_tokenizer(vocab_size)
    vocab = len(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vdims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2)
    vdims.update(vision_dims or {})
    if vision == "clip":
        vcfg = CLIPVisionConfig(image_size=image_size, patch_size=patch_size, projection_dim=64, **vdims)
        improc = CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
    else:
        vcfg = SiglipVisionConfig(image_size=image_size, patch_size=patch_size, **vdims)
        improc = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    common = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if text == "llama":
        common.update(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
        common.update(text_dims or {})
        tcfg = LlamaConfig(**common)
    else:
        common.update(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
        common.update(text_dims or {})
        tcfg = Qwen2Config(**common)
    cfg = LlavaConfig(
        vision_config=vcfg,
        text_config=tcfg,
        image_token_index=image_token_id,
        vision_feature_select_strategy=select_strategy,
        vision_feature_layer=feature_layer,
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    processor = LlavaProcessor(
        image_processor=improc,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=select_strategy,
        chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1 if vision == "clip" else 0,
    )
    processor.save_pretrained(path)
    return path


def build_anyres_checkpoint(
    path: str | Path,
    version: str = "llava_next",
    seed: int = 0,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random LLaVA-NeXT (CLIP tower, "default" features, Llama) or LLaVA-OneVision (SigLIP
    tower, "full" features, Qwen2, `anyres_max_2` so large images are shrunk) checkpoint: 32-px
    tiles of 8-px patches, grids up to 3 x 3 tiles."""
    from transformers import AutoConfig

    path = Path(path)
    tokenizer = build_tokenizer()
    # OneVision's processor counts `<video>` tokens: without one, <unk> would count as video.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<video>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    tile, patch = 32, 8
    pinpoints = [[tile * r, tile * c] for r in (1, 2, 3) for c in (1, 2, 3)]
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2)
    vision.update(image_size=tile, patch_size=patch)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    onevision = version == "llava_onevision"
    cfg = AutoConfig.for_model(
        version,
        vision_config={"model_type": "siglip_vision_model" if onevision else "clip_vision_model", **vision},
        text_config={"model_type": "qwen2" if onevision else "llama", **text},
        image_token_index=image_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full" if onevision else "default",
        vision_feature_layer=-1 if onevision else -2,
        **({"vision_aspect_ratio": "anyres_max_2"} if onevision else {}),
        **({"video_token_index": tokenizer.convert_tokens_to_ids("<video>")} if onevision else {}),
        tie_word_embeddings=False,
    )
    save_random_model(cfg, path, seed, weight_scale, dtype)
    if onevision:
        from transformers import (
            LlavaOnevisionImageProcessor,
            LlavaOnevisionProcessor,
            LlavaOnevisionVideoProcessor,
        )

        LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(
                size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints
            ),
            tokenizer=tokenizer,
            video_processor=LlavaOnevisionVideoProcessor(size={"height": tile, "width": tile}),
            num_image_tokens=(tile // patch) ** 2,
            vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_2",
            chat_template=CHAT_TEMPLATE,
        ).save_pretrained(path)
    else:
        from transformers import LlavaNextImageProcessor, LlavaNextProcessor

        LlavaNextProcessor(
            image_processor=LlavaNextImageProcessor(
                size={"shortest_edge": tile},
                crop_size={"height": tile, "width": tile},
                image_grid_pinpoints=pinpoints,
            ),  # fmt: skip
            tokenizer=tokenizer,
            patch_size=patch,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=CHAT_TEMPLATE,
        ).save_pretrained(path)
    return path
