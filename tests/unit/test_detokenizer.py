from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mm_engine.frontend.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from mm_engine.sampling_params import SamplingParams
from mm_engine.testing.common import WORDS, build_tokenizer

TEXTS = [
    "Héllo wörld! Ça va? naïve café résumé, señor.",
    "日本語のテキストです。中文文本测试,한국어 텍스트.",
    "emoji 😀🎉👍🏽 and a flag 🇫🇷 then family 👨‍👩‍👧 done",
    "The quick brown fox jumps over the lazy dog.",
    "  spaces   and\ttabs\nnew lines  ",
]


@pytest.fixture(scope="module")
def word_tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def bytelevel_tok() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE: non-ASCII characters are split across tokens byte-wise."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")


@pytest.fixture(scope="module")
def llama_tok() -> PreTrainedTokenizerFast:
    """Llama style: '▁' for spaces, leading space stripped on decode, <0xXX> byte fallback."""
    chars = sorted(set("".join(TEXTS[0::3]).replace(" ", "▁")))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({c: len(vocab) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, ids: list[int], params: SamplingParams, rng: random.Random | None = None):
    """Feed ids one at a time (or in random chunks); return (deltas, flushed text, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    deltas, i = [], 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 3) if rng else 1
        deltas.append(detok.step(ids[i : i + n]))
        i += n
    return deltas, detok.flush(), detok


def check_matches_decode(tokenizer, ids: list[int], params: SamplingParams, rng=None) -> list[str]:
    deltas, tail, detok = stream(tokenizer, ids, params, rng)
    expected = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    assert "".join(deltas) + tail == detok.text == expected
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_word_level_random_ids(word_tok, skip: bool) -> None:
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(word_tok)) for _ in range(rng.randint(1, 20))]
        check_matches_decode(word_tok, ids, SamplingParams(skip_special_tokens=skip), rng)


def test_word_level_spaces_around_skipped_specials(word_tok) -> None:
    ids = word_tok("red circle").input_ids
    ids = [word_tok.bos_token_id, ids[0], word_tok.eos_token_id, word_tok.bos_token_id, ids[1]]
    deltas = check_matches_decode(word_tok, ids, SamplingParams(skip_special_tokens=True))
    assert "".join(deltas) == "red circle"
    deltas = check_matches_decode(word_tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "<s> red </s> <s> circle"


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_random_ids_match_full_decode(bytelevel_tok, skip: bool) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(bytelevel_tok)) for _ in range(rng.randint(1, 30))]
        deltas = check_matches_decode(bytelevel_tok, ids, SamplingParams(skip_special_tokens=skip), rng)
        if any("\ufffd" in d for d in deltas):
            # Random bytes are often invalid UTF-8: U+FFFD may stream, but only where decode has it.
            assert "\ufffd" in bytelevel_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_fallback_random_ids_match_full_decode(llama_tok, skip: bool) -> None:
    # ByteFallback turns a whole run of byte tokens into U+FFFD when any byte in it is invalid, so
    # random byte tokens are not used here: each unit is a vocab token, a special token, or the
    # complete byte tokens of a character outside the vocab (split further by random chunking).
    pool = sorted(set("".join(TEXTS)) - set(llama_tok.get_vocab()) - {" "})
    byte_ids = set(range(3, 259))
    plain = [i for i in range(len(llama_tok)) if i not in byte_ids]
    rng = random.Random(1)
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 15)):
            if rng.random() < 0.4:
                ids += [i for i in llama_tok(rng.choice(pool)).input_ids if i in byte_ids]
            else:
                ids.append(rng.choice(plain))
        deltas = check_matches_decode(llama_tok, ids, SamplingParams(skip_special_tokens=skip), rng)
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", ["bytelevel_tok", "llama_tok"])
def test_split_characters_never_stream_replacement_chars(request, name: str) -> None:
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(2)
    for text in TEXTS + ["".join(rng.sample(TEXTS, 5))]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        full = tokenizer.decode(ids)
        assert "\ufffd" not in full
        for chunked in (None, rng):
            deltas = check_matches_decode(tokenizer, ids, SamplingParams(), chunked)
            assert not any("\ufffd" in d for d in deltas)
    # The emoji really is split across tokens in both tokenizers, so the hold-back is exercised.
    assert any("\ufffd" in tokenizer.decode([i]) for i in tokenizer("😀", add_special_tokens=False).input_ids)


def test_special_tokens_in_byte_level_output(bytelevel_tok) -> None:
    eos = bytelevel_tok.eos_token_id
    ids = bytelevel_tok("café 😀", add_special_tokens=False).input_ids + [eos]
    assert "".join(check_matches_decode(bytelevel_tok, ids, SamplingParams())) == "café 😀"
    kept = check_matches_decode(bytelevel_tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(kept) == "café 😀<|endoftext|>"


def test_window_stays_small(bytelevel_tok) -> None:
    lengths: list[int] = []

    class Recording:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return bytelevel_tok.decode(ids, **kwargs)

    ids = bytelevel_tok(" ".join(TEXTS * 10), add_special_tokens=False).input_ids
    assert len(ids) > 500
    check_matches_decode(Recording(), ids, SamplingParams())
    # The last two decodes are flush(); every step decodes a short window whatever the length.
    assert max(lengths[:-2]) <= MAX_PENDING_TOKENS


def test_stop_string_spanning_tokens_word_level(word_tok) -> None:
    ids = word_tok("the red circle is big and small").input_ids
    params = SamplingParams(stop=["circle is"])
    deltas, tail, detok = stream(word_tok, ids, params)
    assert detok.stopped and detok.stop_str == "circle is"
    assert "".join(deltas) == detok.text == "the red "
    assert tail == "" and detok.step(ids[:2]) == "" and detok.text == "the red "
    # Nothing that might start the stop string is streamed before it is decided.
    assert deltas[:4] == ["the", " red", " ", ""]

    params = SamplingParams(stop=["circle is"], include_stop_str_in_output=True)
    deltas, _, detok = stream(word_tok, ids, params)
    assert "".join(deltas) == detok.text == "the red circle is"


def test_held_back_text_is_released_when_the_stop_does_not_come(word_tok) -> None:
    params = SamplingParams(stop=["big small"])
    ids = word_tok("red big red big").input_ids
    deltas, tail, detok = stream(word_tok, ids, params)
    assert deltas == ["red", " ", "big red", " "]
    assert tail == "big" and not detok.stopped
    assert "".join(deltas) + tail == detok.text == "red big red big"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_inside_multibyte_text(bytelevel_tok, include: bool) -> None:
    rng = random.Random(3)
    for text in TEXTS:
        ids = bytelevel_tok(text, add_special_tokens=False).input_ids
        full = bytelevel_tok.decode(ids)
        for _ in range(10):
            start = rng.randrange(len(full) - 3)
            stop = full[start : start + rng.randint(1, 3)]
            params = SamplingParams(stop=[stop, "never appears"], include_stop_str_in_output=include)
            deltas, tail, detok = stream(bytelevel_tok, ids, params, rng)
            pos = full.find(stop)
            expected = full[: pos + len(stop)] if include else full[:pos]
            assert detok.stopped and tail == ""
            assert "".join(deltas) == detok.text == expected
            assert not any("\ufffd" in d for d in deltas)


def test_earliest_stop_wins(word_tok) -> None:
    ids = word_tok("one two three").input_ids
    deltas, _, detok = stream(word_tok, ids, SamplingParams(stop=["three", "two"]))
    assert detok.stop_str == "two" and "".join(deltas) == "one "


def test_stop_on_words_from_the_tiny_vocab(word_tok) -> None:
    rng = random.Random(4)
    for _ in range(50):
        words = rng.choices(WORDS[:10], k=12)
        ids = word_tok(" ".join(words)).input_ids
        stop = " ".join(rng.sample(WORDS[:10], 2))
        deltas, tail, detok = stream(word_tok, ids, SamplingParams(stop=[stop]), rng)
        full = word_tok.decode(ids)
        pos = full.find(stop)
        assert detok.stopped == (pos != -1)
        assert "".join(deltas) + tail == detok.text == (full[:pos] if pos != -1 else full)
