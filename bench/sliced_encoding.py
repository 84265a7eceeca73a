"""What one big image costs the streams already running: encoded whole in a step, or a share of
its tower a step (`sliced_encoding`), side by side in one run.

    python -m bench.sliced_encoding [--model bench-qwen2.5-vl] [--streams 8] [--image-px 896]
                                    [--caps 768,256] [--rounds 3] [--json PATH]

Per setting (a prefill cap `decode_step_prefill_tokens`, slicing on or off), an engine in this
process runs `--streams` text requests; once they all decode, one image request arrives (a
`--image-px` square picture: 1,024 image tokens on the Qwen2.5-VL benchmark model, its largest).
Steps are driven by hand and timed; each engine is warmed up first, and each round sends a new
picture (a repeated one would come from the caches). Figures: the streams' longest gap between two
tokens (ITL max) and their p99 from the image's arrival until its first token, the image's time to
first token, and the streams' ITL median before it arrived (idle). Settings run in turns, `--rounds` times;
the engines' greedy tokens are compared (slicing must not change them).

`--paused-probe`: the running streams' decode steps alone, timed with an image's encode begun and
paused between two shares and without one, in turns; a paused encode must not slow the steps
around it (one on a thread of its own did: a second OpenMP team).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from bench import vlm
from bench.machine import machine_info
from bench.save import save_json
from mm_engine import LLM, SamplingParams

STORY = "<|im_start|>user\ntell me a long story about {}<|im_end|>\n<|im_start|>assistant\n"


def run_once(llm: LLM, streams: int, image, prompt: str, out_tokens: int) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    ids = [eng.add_request(STORY.format(i), params) for i in range(streams)]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {}
    seen: dict[str, int] = {}
    image_id, arrived = None, None
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            got = list(o.outputs[0].token_ids)
            if len(got) > seen.get(o.request_id, 0):
                stamps.setdefault(o.request_id, []).append(now)
            seen[o.request_id] = len(got)
            tokens[o.request_id] = got
        if image_id is None and all(len(stamps[r]) >= 4 for r in ids):  # all of them decoding
            arrived = time.perf_counter()
            image_id = eng.add_request({"prompt": prompt, "multi_modal_data": {"image": image}}, params)
    first = stamps[image_id][0]
    before, during = [], []  # the streams' gaps before the image arrived, and until its first token
    for rid in ids:
        for a, b in zip(stamps[rid], stamps[rid][1:], strict=False):
            if b <= arrived:
                before.append(b - a)
            elif a < first:
                during.append(b - a)
    return {
        "image_ttft_s": first - arrived,
        "itl_max_during_s": max(during),
        "itl_p99_during_s": float(np.percentile(during, 99)),
        "itl_median_before_s": statistics.median(before),
        "tokens": [tokens[r] for r in [*ids, image_id]],
    }


def paused_probe(llm: LLM, streams: int, span_prompt: dict, rounds: int, steps: int = 12) -> dict:
    """Median decode-step time of `streams` running requests, alone and beside a paused encode."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * rounds * steps + 16, ignore_eos=True)
    for i in range(streams):
        eng.add_request(STORY.format(i), params)
    for _ in range(4):  # prefill, then decoding
        eng.step()
    _, _, spans = eng.inputs.process(span_prompt)
    slices = eng.core.runner.features.slices
    one_layer = -(-spans[0].num_embeds // slices.depth)
    times: dict[str, list[float]] = {"alone": [], "beside a paused encode": []}
    for r in range(rounds):
        for paused in (False, True) if r % 2 == 0 else (True, False):
            if paused:
                assert slices.advance(spans[0], one_layer, "probe") is None  # begun, paused
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                times["beside a paused encode" if paused else "alone"].append(time.perf_counter() - t0)
            slices.release("probe")
    for rid in list(eng.core.requests):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-qwen2.5-vl")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--image-px", type=int, default=896)
    ap.add_argument("--out-tokens", type=int, default=96)
    ap.add_argument("--caps", default="768,256", help="decode_step_prefill_tokens values")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--paused-probe", action="store_true", help="decode steps beside a paused encode")
    args = ap.parse_args()
    path = vlm.resolve_model(args.model)
    prompt, _ = vlm.prompts_for(path)
    # A new picture every run (a repeated one would come from the encoder and prefix caches).
    pictures = iter(vlm.images(args.rounds * 5 + 5, seed=3))
    image = lambda: next(pictures).resize((args.image_px, args.image_px))  # noqa: E731
    if args.paused_probe:
        llm = LLM(path, kv_cache_memory_bytes=1 << 30)
        run_once(llm, 2, image(), prompt, 8)  # warm-up
        res = paused_probe(llm, args.streams, {"prompt": prompt, "multi_modal_data": {"image": image()}},
                           args.rounds)  # fmt: skip
        ratio = res["beside a paused encode"] / res["alone"]
        print(" | ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in res.items()) + f" | ratio {ratio:.2f}")
        save_json(args.json, {"what": "decode steps beside a paused sliced encode (bench.sliced_encoding)",
                              "model": args.model, "streams": args.streams, "rounds": args.rounds,
                              "step_median_s": res, "ratio": ratio, "machine": machine_info()})  # fmt: skip
        return
    settings = [(int(c), s) for c in args.caps.split(",") for s in (False, True)]
    engines = {
        (cap, sliced): LLM(
            path, decode_step_prefill_tokens=cap, sliced_encoding=sliced, kv_cache_memory_bytes=1 << 30
        )
        for cap, sliced in settings
    }
    for llm in engines.values():  # warm-up, not timed: first-touch of pools, packed weights
        run_once(llm, 2, image(), prompt, 8)
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        picture = image()  # the same for every engine in a round (each has caches of its own)
        for cap, sliced in settings if r % 2 == 0 else settings[::-1]:
            key = f"cap {cap}, {'sliced' if sliced else 'whole'}"
            res = run_once(engines[cap, sliced], args.streams, picture, prompt, args.out_tokens)
            runs.setdefault(key, []).append(res)
            ttft, itl = res["image_ttft_s"], res["itl_max_during_s"]
            print(f"round {r} {key}: image TTFT {ttft:.3f} s, streams' ITL max {itl:.3f} s")
    # Per round and cap: slicing moves where the image's prompt is cut, never what the tower computes.
    identical = {
        cap: all(
            a["tokens"] == b["tokens"]
            for a, b in zip(runs[f"cap {cap}, whole"], runs[f"cap {cap}, sliced"], strict=True)
        )
        for cap in {c for c, _ in settings}
    }
    rows = {}
    print(f"\ngreedy tokens identical, sliced vs whole, per cap: {identical}")
    print("| setting | ITL max (s) | ITL p99 (s) | image TTFT (s) | idle ITL median (s) |")
    print("|---|---:|---:|---:|---:|")
    for key, rs in runs.items():
        row = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "tokens"}
        row["per_round"] = [{k: v for k, v in x.items() if k != "tokens"} for x in rs]
        rows[key] = row
        print(
            f"| {key} | {row['itl_max_during_s']:.3f} | {row['itl_p99_during_s']:.3f} | "
            f"{row['image_ttft_s']:.3f} | {row['itl_median_before_s']:.4f} |"
        )
    save_json(args.json, {
        "what": "streams' ITL while one big image is encoded whole or in shares (bench.sliced_encoding)",
        "model": args.model, "streams": args.streams, "image_px": args.image_px, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "settings": rows,
        "tokens_identical": {str(k): v for k, v in identical.items()},
        "machine": machine_info(),
    })  # fmt: skip


if __name__ == "__main__":
    main()
