"""What every family's tiny checkpoint shares: the word-level and byte-level tokenizers trained
with `tokenizers`, the tiny language-model config, and random weights saved with `save_pretrained`.
Nothing is downloaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
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


def save_random_model(
    cfg, path: Path, seed: int, weight_scale: float, dtype: torch.dtype, adjust: Callable | None = None
) -> None:
    """transformers' model for `cfg` with random weights, saved as a checkpoint; `adjust(model)`
    (seeded too) may set what random matrices leave at their constant init."""
    from transformers import AutoModelForImageTextToText

    # The seed applies inside this block only: the caller's random stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(cfg).eval()
    with torch.no_grad():  # random init is near zero: scale up so greedy ties are unlikely
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(weight_scale)
        if adjust is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 1)
                adjust(model)
    model.to(dtype).save_pretrained(path)
