"""Structured output's cost, side by side: the same batch decoded unconstrained and under a JSON
schema, alternating, on a byte-level checkpoint (grammars need one; the bench models' word-level
tokenizers cannot spell JSON).

    python -m bench.structured_output [--requests 32] [--max-tokens 64] [--rounds 3] [--vocab-size 32768]
                                      [--device cpu]
                                      [--json bench/results/structured_output.json]

Every request runs to `max-tokens` (ignore_eos; a schema whose strings are free keeps the grammar
open), so both sides decode the same number of tokens; the figure is seconds per output token.
The grammar is compiled once before timing (compiles are cached per schema). Checked: every
constrained output starts as the schema's object does, and the free outputs differ from them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.models.platform import environment
from mm_engine.sampling_params import StructuredOutputs
from mm_engine.testing import build_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"caption": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["caption", "tags"],
}
# A language model big enough that a step is not all host work (the bench model's text side).
TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
            num_key_value_heads=3)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=32768, help="padded with filler tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = build_checkpoint("llava", tempfile.mkdtemp(prefix="mm-bench-so-"), byte_level=True, text_dims=TEXT,
                            vocab_size=args.vocab_size)  # fmt: skip
    llm = LLM(str(path), device=args.device, max_num_seqs=256)
    prompts = [f"USER: describe picture {i} ASSISTANT:" for i in range(args.requests)]

    def params(constrained: bool) -> list[SamplingParams]:
        so = StructuredOutputs(json=SCHEMA) if constrained else None
        return [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
                               structured_outputs=so) for i in range(args.requests)]  # fmt: skip

    llm.generate(prompts[:2], params(True)[:2])  # warm-up, and the grammar compiled (cached)
    seconds = {"free": [], "json_schema": []}
    texts = {}
    for _ in range(args.rounds):
        for name in seconds:
            start = time.perf_counter()
            outs = llm.generate(prompts, params(name == "json_schema"))
            seconds[name].append(time.perf_counter() - start)
            texts[name] = [o.outputs[0].text for o in outs]
    tokens = args.requests * args.max_tokens
    free, constrained = (sum(seconds[k]) / args.rounds for k in ("free", "json_schema"))
    result = {
        "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "vocab_size": args.vocab_size, "device": args.device, "seconds": seconds,
        "free_tokens_per_s": tokens / free, "json_schema_tokens_per_s": tokens / constrained,
        "overhead": constrained / free - 1.0,
        "constrained_start_with_brace": all(t.lstrip().startswith("{") for t in texts["json_schema"]),
        "outputs_differ": texts["free"] != texts["json_schema"],
        "machine": machine_info(), "environment": environment(),
    }  # fmt: skip
    print(f"{'decoding':<12} {'seconds':>8} {'tok/s':>8}")
    print(f"{'free':<12} {free:8.2f} {tokens / free:8.1f}")
    print(f"{'json_schema':<12} {constrained:8.2f} {tokens / constrained:8.1f}")
    print(f"overhead of the grammar: {100 * result['overhead']:+.1f}%")
    if args.json is not None:
        save_json(args.json, result)
    return 0 if result["constrained_start_with_brace"] and result["outputs_differ"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
