"""Give the trained demo model a byte-level BPE vocabulary, so that it can spell any text (JSON mode,
tool calls, a grammar) while it reads and writes its own words exactly as before.

    python -m bench.retokenize_demo [--model mm_engine/demo/demo_model]

The demo model is trained on a word-level vocabulary (`bench.train_demo`): 45 words and four
punctuation marks, so no grammar that needs a brace or a quote could ever start. This rewrites
the checkpoint in place (`bench.train_demo` runs it after training):

- the tokenizer becomes byte-level BPE (GPT-2's byte alphabet, lower-cased like before), with
  every old word a single token both bare and after a space ("circle", "Ġcircle"); `<image>`
  and `</s>` swallow the spaces beside them, so every prompt the old tokenizer read tokenizes to
  the same number of tokens, each embedded as before (checked here on every prompt kind);
- a new token's input embedding is the old one of its word, else the colon's (`UNSEEN_READS_AS`);
- the chat template lists a request's tools by name and names Hermes' tool-call tags, so that
  tools work with a named or required `tool_choice` (their arguments follow the schema's grammar);
- output rows: a spaced word writes as the old word did, so text comes out spaced as it reads
  ("ASSISTANT: a red circle."); a bare word, and every byte the model never saw, gets `<unk>`'s
  row (never the greedy choice); the quote and the closing brackets get `</s>`'s row a little
  smaller, so that under a grammar, where `</s>` is not allowed until the value is complete, the
  model closes a string or an object where it would have stopped. Greedy text without a grammar
  is unchanged (`bench.eval_demo` compares).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from mm_engine.demo import scenes

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "mm_engine" / "demo" / "demo_model"
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]  # ids 0-4, as the word-level vocabulary has them
CLOSERS = ('"', "}", "]")  # written where the model would stop, when a grammar forbids stopping there
CLOSER_SCALE = 0.999  # below </s> itself, so that without a grammar </s> still wins
SPACE = "Ġ"  # the byte-level alphabet's space
# What a token the model never saw reads as: the colon that ends "ASSISTANT:", so that a JSON
# scaffold ('{"caption": "') reads like the prompt's end and the answer that follows is the one the
# model would give (with <unk>'s embedding it wrote '{"caption": "."}' for most scenes).
UNSEEN_READS_AS = ":"
# Tools, where a request has some: their names only (the context is 256 tokens); a named or
# required tool_choice has the arguments written under their schema's grammar. The comment
# names Hermes' tags, the tool-call format the engine then reads (`tool_format_for`).
TOOLS = (
    '{# tool calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call> #}'
    "{% if tools %}SYSTEM: tools {% for tool in tools %}"
    "{{ tool['function']['name'] if 'function' in tool else tool['name'] }} {% endfor %}{% endif %}"
)


def byte_level_tokenizer(words: list[str]) -> Tokenizer:
    """Byte-level BPE over GPT-2's alphabet whose merges make each of `words` one token, bare and
    spaced; lower-cased like the old tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken("<pad>", special=True, normalized=False),
        AddedToken("<unk>", special=True, normalized=False),
        AddedToken("<s>", special=True, normalized=False, rstrip=True),
        AddedToken("</s>", special=True, normalized=False, lstrip=True, rstrip=True),
        AddedToken("<image>", special=True, normalized=False, lstrip=True, rstrip=True),
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # more than the merges need: training stops once every word is one token
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([f"{w} {w}" for w in words for _ in range(4)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return tok


def old_rows(new: dict[str, int], old: dict[str, int]) -> tuple[list[int], list[int]]:
    """For each new id: the old id whose input embedding it takes, and whose output row."""
    unk, eos = old["<unk>"], old["</s>"]
    embed, out = [old[UNSEEN_READS_AS]] * len(new), [unk] * len(new)
    for token, i in new.items():
        word = token.removeprefix(SPACE)
        if token in SPECIALS:
            embed[i] = out[i] = old[token]
        elif word in old:
            embed[i] = old[word]
            # Spaced words write as before; punctuation writes bare ("circle." not "circle .").
            out[i] = old[word] if token.startswith(SPACE) or not word.isalpha() else unk
        elif token in CLOSERS:
            out[i] = eos
    return embed, out


def check_prompts(new: PreTrainedTokenizerFast, old: PreTrainedTokenizerFast, embed: list[int]) -> int:
    """Every prompt kind the model was trained on reads as the same old ids; how many were checked."""
    rng = random.Random(0)
    pairs = [pair for _ in range(100) for pair in scenes.qa_pairs(scenes.random_scene(rng), rng)]
    prompts = [scenes.prompt(q) + " " + a for q, a in pairs]  # each question with its answer
    for q, a in pairs[:20]:
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]},
                {"role": "assistant", "content": a}, {"role": "user", "content": q}]  # fmt: skip
        prompts.append(old.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    for text in prompts:
        was, now = old(text)["input_ids"], [embed[i] for i in new(text)["input_ids"]]
        if was != now:
            raise RuntimeError(f"{text!r} reads differently: {was} became {now}")
    return len(prompts)


def with_tools(template: str) -> str:
    """The chat template with the tools' names after the BOS (unchanged without tools)."""
    bos = "{{ bos_token }}"
    return template if TOOLS in template else template.replace(bos, bos + TOOLS, 1)


def retokenize(model_dir: Path) -> dict[str, int]:
    old_tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    old = old_tok.get_vocab()
    if len(old) != len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]):
        raise RuntimeError("the tokenizer has tokens outside its vocabulary; not the word-level demo one")
    tok = byte_level_tokenizer([w for w in old if w not in SPECIALS and w.isalpha()])
    new = tok.get_vocab()
    for token in SPECIALS:
        if new[token] != old[token]:
            raise RuntimeError(f"{token} moved from id {old[token]} to {new[token]}")
    embed, out = old_rows(new, old)
    new_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, extra_special_tokens={"image_token": "<image>"},
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
    )  # fmt: skip
    checked = check_prompts(new_tok, old_tok, embed)
    weights = load_file(model_dir / "model.safetensors")
    e_key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    o_key = next(k for k in weights if k.endswith("lm_head.weight"))
    e, o = weights[e_key], weights[o_key]
    weights[e_key] = e[torch.tensor(embed)].contiguous()
    rows = o[torch.tensor(out)].clone()
    for token in CLOSERS:
        rows[new[token]] *= CLOSER_SCALE
    weights[o_key] = rows.contiguous()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["vocab_size"] = len(new)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    template = (model_dir / "chat_template.jinja").read_text()
    new_tok.save_pretrained(model_dir)  # tokenizer.json and tokenizer_config.json
    (model_dir / "chat_template.jinja").write_text(with_tools(template))
    return {"old_vocab": len(old), "new_vocab": len(new), "prompts_checked": checked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    print(retokenize(ap.parse_args().model))


if __name__ == "__main__":
    main()
