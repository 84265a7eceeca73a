"""Prefix reuse of a hybrid model (Qwen3.5), side by side: a multi-turn chat about one image with
state snapshots (prefix reuse on) and without (`num_state_snapshots=0`: a hybrid model then has
no prefix reuse at all).

    python -m bench.hybrid_reuse [--model bench-qwen3.5] [--turns 4] [--answer-tokens 16] [--json PATH]

Each turn sends the whole conversation so far (the image, the questions, the model's own answers)
plus a new question, as a chat frontend does. The two setups run alternately, A B A B, each in a
fresh engine; per turn the figures are the mean of their two runs. Reported: per turn the prompt
tokens, the tokens taken from cache and the seconds of each setup; the hit rate (cached / prompt
tokens over turns 2..N); what a snapshot costs: its bytes (one state slot) and the first turn's
time with snapshots against without (nothing is cached on the first turn either way, so the
difference is the cost of writing them). The answers must be the same token for token.
"""

from __future__ import annotations

import argparse
import time

from bench import vlm
from bench.machine import machine_info
from bench.save import save_json
from mm_engine import LLM, SamplingParams

QUESTIONS = (
    "what is in this picture",
    "how many shapes are there",
    "describe the color of the left shape",
    "tell me about the shape on the right and where it is",
    "which one is the largest",
    "is there anything else",
)


def conversation(model: str, image_url: str, turns: int, answer_tokens: int, snapshots: bool, threads: int):
    """One conversation in a fresh engine: per turn (prompt tokens, cached tokens, seconds, answer ids)."""
    import torch

    torch.set_num_threads(threads)
    extra = {} if snapshots else {"num_state_snapshots": 0}
    llm = LLM(model, kv_cache_memory_bytes=2 * 1024**3, max_num_batched_tokens=2048, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    messages, rows = [], []
    for k in range(turns):
        question = QUESTIONS[k % len(QUESTIONS)]
        content = [{"type": "image_url", "image_url": {"url": image_url}}] if k == 0 else []
        messages.append({"role": "user", "content": [*content, {"type": "text", "text": question}]})
        start = time.perf_counter()
        out = llm.chat(messages, params)[0]
        seconds = time.perf_counter() - start
        rows.append((len(out.prompt_token_ids), out.num_cached_tokens, seconds, out.outputs[0].token_ids))
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    state = llm.kv_report()["state"]
    llm.close()
    return rows, state


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-qwen3.5")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import base64
    import io

    import torch

    threads = args.threads or torch.get_num_threads()
    model = vlm.resolve_model(args.model)
    buf = io.BytesIO()
    vlm.images(1, seed=0)[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    runs = {True: [], False: []}
    states = {}
    for snapshots in (True, False, True, False):
        rows, states[snapshots] = conversation(model, url, args.turns, args.answer_tokens, snapshots, threads)
        runs[snapshots].append(rows)
    same = all(a[3] == b[3] for x in runs[True] for y in runs[False] for a, b in zip(x, y, strict=True))

    def mean_seconds(snapshots: bool, k: int) -> float:
        return sum(run[k][2] for run in runs[snapshots]) / len(runs[snapshots])

    turns = []
    for k in range(args.turns):
        prompt, cached = runs[True][0][k][0], runs[True][0][k][1]
        turns.append({
            "turn": k + 1, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_tokens_without": runs[False][0][k][1],
            "seconds_with_snapshots": mean_seconds(True, k), "seconds_without": mean_seconds(False, k),
        })  # fmt: skip
    later = turns[1:]
    hit_rate = sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later))
    result = {
        "model": args.model,
        "machine": machine_info(),
        "threads": threads,
        "turns": turns,
        "hit_rate_turns_2_on": hit_rate,
        "answers_identical": same,
        "state_bytes_per_slot": states[True]["bytes_per_slot"],
        "snapshot_bytes": states[True]["bytes_per_slot"],
        "snapshots_saved": states[True]["snapshots_saved"],
        "snapshots_restored": states[True]["snapshots_restored"],
        "first_turn_snapshot_cost": turns[0]["seconds_with_snapshots"] / turns[0]["seconds_without"] - 1,
        "later_turns_speedup": sum(t["seconds_without"] for t in later)
        / max(1e-9, sum(t["seconds_with_snapshots"] for t in later)),
    }
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'s with':>8} {'s without':>10}")
    for t in turns:
        print(f"{t['turn']:>4} {t['prompt_tokens']:>7} {t['cached_tokens']:>7} "
              f"{t['seconds_with_snapshots']:>8.2f} {t['seconds_without']:>10.2f}")  # fmt: skip
    print(f"hit rate (turns 2..): {hit_rate:.1%}; later turns {result['later_turns_speedup']:.2f}x faster; "
          f"first turn with snapshots {result['first_turn_snapshot_cost']:+.1%}; "
          f"a snapshot is {result['snapshot_bytes']:,} bytes; answers identical: {same}")  # fmt: skip
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
