"""The mixture-of-experts layer on CPU, side by side in one process: the engine's grouped experts
(models/layers/moe.py) against transformers' own block (Qwen3-VL-MoE's) on the same weights, and
against a dense SwiGLU MLP as wide as the experts a token uses (its "active" twin).

    python -m bench.moe [--tokens 1 16 256 2048] [--threads 2] [--json bench/results/moe.json]

Shapes are Qwen3-VL-30B-A3B's, scaled down to fit a small machine: hidden 2048, 128 experts of
width 768, 8 per token, cut to `--experts` (default 32) so that the weights stay in memory. Rounds
alternate the three; each figure is the best of `--reps`.
"""

from __future__ import annotations

import argparse

import torch

from bench.machine import best_seconds, machine_info
from bench.save import save_json
from mm_engine.models.layers.moe import SparseMoE


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextMLP,
        Qwen3VLMoeTextSparseMoeBlock,
    )

    cfg = Qwen3VLMoeTextConfig(
        hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.width, hidden_act="silu",
    )  # fmt: skip
    ours = SparseMoE(cfg).eval()
    theirs = Qwen3VLMoeTextSparseMoeBlock(cfg).eval()
    dense = Qwen3VLMoeTextMLP(cfg, intermediate_size=args.width * args.top_k).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (*ours.parameters(), *dense.parameters()):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj.transpose(1, 2))
        theirs.experts.down_proj.copy_(ours.experts.down_proj.transpose(1, 2))
    rows = []
    print("| tokens | ours (ms) | transformers (ms) | dense active twin (ms) | transformers / ours |"
          " dense / ours |\n|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randn(n, args.hidden, generator=gen)
            torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-3, atol=1e-4)
            runs = {"ours": lambda x=x: ours(x), "transformers": lambda x=x: theirs(x[None]),
                    "dense": lambda x=x: dense(x)}  # fmt: skip
            times = dict.fromkeys(runs, float("inf"))
            for _ in range(2):  # alternate, so that drift hits all three
                for name, fn in runs.items():
                    times[name] = min(times[name], best_seconds(fn, args.reps))
            row = {"tokens": n, **{k: v * 1e3 for k, v in times.items()}}
            row["transformers_over_ours"] = times["transformers"] / times["ours"]
            row["dense_over_ours"] = times["dense"] / times["ours"]
            rows.append(row)
            print(f"| {n} | {row['ours']:.2f} | {row['transformers']:.2f} | {row['dense']:.2f} | "
                  f"{row['transformers_over_ours']:.2f} | {row['dense_over_ours']:.2f} |")  # fmt: skip
    result = {"machine": machine_info(), "args": vars(args), "rows": rows}
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
