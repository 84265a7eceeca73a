"""Held-out accuracy of the demo model through the engine, and its agreement with transformers.

    python -m bench.eval_demo [--model PATH] [--scenes 300] [--seed 0] [--compare 10] [--threads 2]

Scenes come from a seed stream training never draws from ("held-out-N"; training uses "tower-N",
"text-N", "tune-N" and "probe"), a third with each number of shapes. Every scene is asked for its
caption, its count, the colour of each shape whose kind is there once, and one yes and one no
question; an answer counts only if the greedy text equals the target exactly.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from mm_engine import LLM, SamplingParams
from mm_engine.demo import scenes

DEMO_MODEL = Path(__file__).resolve().parent.parent / "mm_engine" / "demo" / "demo_model"
KV_BYTES = 64 * 1024**2  # plenty for this model; the CPU default (2 GiB) only costs time to zero
MAX_TOKENS = 24  # the longest caption is 16 tokens plus EOS


def questions(scene_list: list[scenes.Scene], seed: int = 0) -> list[tuple[str, int, str, str]]:
    """(metric, scene index, question, answer) for every question asked of the scenes."""
    rng = random.Random(f"held-out-questions-{seed}")
    out = []
    for i, scene in enumerate(scene_list):
        metric = "caption_1_2" if len(scene.shapes) < 3 else "caption_3"
        out.append((metric, i, scenes.CAPTION_PROMPT, scenes.caption(scene)))
        out.append(("count", i, scenes.COUNT_QUESTION, scenes.count_answer(scene.shapes)))
        out += [("colour", i, q, a) for q, a in scenes.colour_questions(scene.shapes)]
        out += [("yes_no", i, q, a) for q, a in scenes.yes_no_questions(scene.shapes, rng)]
    return out


def evaluate(llm: LLM, n_scenes: int = 300, seed: int = 0, show: int = 0) -> dict[str, tuple[int, int]]:
    """{metric: (right, asked)} over `n_scenes` held-out scenes, all asked in one batch."""
    scene_list = scenes.held_out_scenes(n_scenes, seed)
    asked = questions(scene_list, seed)
    prompts = [
        {"prompt": scenes.prompt(q), "multi_modal_data": {"image": scene_list[i].image}}
        for _, i, q, _ in asked
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    score: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for (metric, _, q, want), out in zip(asked, outs, strict=True):
        got = out.outputs[0].text.strip()
        score[metric][0] += got == want
        score[metric][1] += 1
        if got != want and show > 0:
            show -= 1
            print(f"  miss [{metric}] {q!r}: got {got!r}, want {want!r}")
    return {k: (v[0], v[1]) for k, v in score.items()}


def compare_with_transformers(model_path: str | Path, llm: LLM, n_scenes: int = 10, seed: int = 0) -> int:
    """How many of `n_scenes` captions differ, token for token, between the engine and
    transformers' `LlavaForConditionalGeneration.generate` (greedy, float32)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_path)
    ref = LlavaForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    text = scenes.prompt(scenes.CAPTION_PROMPT)
    scene_list = scenes.held_out_scenes(n_scenes, seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": s.image}} for s in scene_list], params
    )
    differ = 0
    for scene, out in zip(scene_list, outs, strict=True):
        inputs = processor(text=text, images=[scene.image], return_tensors="pt")
        with torch.inference_mode():
            ids = ref.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        differ += ids[0, inputs["input_ids"].shape[1] :].tolist() != list(out.outputs[0].token_ids)
    return differ


def report(model_path: str | Path, n_scenes: int, seed: int, compare: int, show: int = 0) -> dict[str, float]:
    llm = LLM(str(model_path), kv_cache_memory_bytes=KV_BYTES)
    start = time.perf_counter()
    score = evaluate(llm, n_scenes, seed, show)
    seconds = time.perf_counter() - start
    print(f"held-out accuracy through the engine ({n_scenes} scenes, seed {seed}, greedy, {seconds:.0f}s):")
    for metric in ("caption_1_2", "caption_3", "count", "colour", "yes_no"):
        right, asked = score[metric]
        print(f"  {metric:12s} {right / asked:7.2%}  ({right}/{asked})")
    if compare:
        differ = compare_with_transformers(model_path, llm, compare, seed)
        print(f"engine vs transformers greedy tokens: {compare - differ}/{compare} captions identical")
    return {k: r / a for k, (r, a) in score.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--scenes", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", type=int, default=10, help="scenes compared with transformers (0: none)")
    ap.add_argument("--show", type=int, default=10, help="misses to print")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report(args.model, args.scenes, args.seed, args.compare, args.show)


if __name__ == "__main__":
    main()
