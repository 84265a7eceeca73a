"""Build small random LLaVA checkpoints the way a user's real one looks on disk (for tests and
benchmarks; random weights generate arbitrary tokens).

Everything is made here: a word-level tokenizer trained with `tokenizers`, a CLIP or SigLIP
vision tower, a Llama or Qwen2 language model, a `LlavaProcessor` with a chat template, all saved
with `save_pretrained`. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2Config,
    SiglipImageProcessor,
    SiglipVisionConfig,
)

WORDS = [
    "a",
    "an",
    "the",
    "is",
    "are",
    "what",
    "how",
    "many",
    "color",
    "shape",
    "image",
    "picture",
    "describe",
    "this",
    "there",
    "of",
    "in",
    "and",
    "red",
    "green",
    "blue",
    "yellow",
    "circle",
    "square",
    "triangle",
    "left",
    "right",
    "top",
    "bottom",
    "big",
    "small",
    "one",
    "two",
    "three",
    "yes",
    "no",
    "question",
    "answer",
    "user",
    "assistant",
    "photo",
    "show",
    "me",
    "tell",
    "about",
    "where",
    "which",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Word level over WORDS; with `vocab_size`, filler words `w<N>` pad the vocabulary to that
    size, so that a benchmark model's embedding and LM head have a real model's shape."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = [" ".join(WORDS)] * 4 + [w.upper() + ":" for w in ("user", "assistant")]
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>", "<image>"])
    tok.train_from_iterator(corpus, trainer=trainer)
    if vocab_size is not None and vocab_size > tok.get_vocab_size():
        tok.add_tokens([f"w{i}" for i in range(vocab_size - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    return fast


def build_bytelevel_tokenizer(
    vocab_size: int | None = None, special: list[str] | None = None, **names: str
) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2's scheme) trained on WORDS and some JSON: every string has tokens, so
    grammars (JSON, regex) can be followed, unlike the word-level tokenizers. `vocab_size` pads
    it with filler words `w<N>`, for a grammar's per-token work at a real vocabulary's size.
    `special` and `names` (eos_token=..., pad_token=...): another family's special tokens than
    LLaVA's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    json_bits = [
        '{"caption": "a red circle", "tags": ["red", "circle"], "count": 2}',
        "[1, 2, 3] true false null",
    ]
    corpus = [" ".join(WORDS)] * 4 + json_bits * 4 + [w.upper() + ":" for w in ("user", "assistant")]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<unk>", "<s>", "</s>", "<image>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    if special is not None:
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    tok.train_from_iterator(corpus, trainer=trainer)
    if vocab_size is not None and vocab_size > tok.get_vocab_size():
        tok.add_tokens([f"w{i}" for i in range(vocab_size - tok.get_vocab_size())])
    if special is not None:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
        fast.add_special_tokens({"additional_special_tokens": special})
        return fast
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )  # fmt: skip


def word_tokenizer(
    special: list[str], extra_words: str, vocab_size: int | None = None, **tokens
) -> PreTrainedTokenizerFast:
    """Word level over WORDS and `extra_words`, with `special` as special tokens (after `<unk>`)
    and `vocab_size` filled with `w<N>` words; `tokens` names the eos/pad/... ones."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *special])
    tok.train_from_iterator([" ".join(WORDS)] * 4 + [extra_words], trainer=trainer)
    if vocab_size is not None and vocab_size > tok.get_vocab_size():
        tok.add_tokens([f"w{i}" for i in range(vocab_size - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **tokens)
    fast.add_special_tokens({"additional_special_tokens": special})
    return fast


def tiny_text(vocab_size: int, eos: int, pad: int, bos: int | None, overrides: dict | None, **family) -> dict:
    """The tiny language-model config every family's test checkpoint shares (hidden 128, two
    layers, GQA 4:2, head size 32), with the family's own keys and the caller's overrides."""
    text = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=eos, pad_token_id=pad, bos_token_id=bos,
    )  # fmt: skip
    return {**text, **family, **(overrides or {})}


def save_random_model(cfg, path: Path, seed: int, weight_scale: float, dtype: torch.dtype) -> None:
    """transformers' model for `cfg` with random weights, saved as a checkpoint."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    with torch.no_grad():  # random init is near zero: scale up so greedy ties are unlikely
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(weight_scale)
    model.to(dtype).save_pretrained(path)


def build_checkpoint(
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
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    # Random init is near zero; scale up so logits are peaked and greedy ties are unlikely.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(weight_scale)
    model.to(dtype).save_pretrained(path)
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
            video_processor=LlavaOnevisionVideoProcessor(),
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
