"""Low-bit weights on CPU (`quantization`), side by side in one run: per setting, the decode step
at batch 1, 8 and 32 against fp32 and against the roofline of the bytes the step reads, a caption
and a chat job, and how far the greedy output moves from fp32's.

    python -m bench.quantized [--model bench-qwen2.5-vl] [--batch-sizes 1,8,32]
                              [--settings fp32,bf16,fp8,int8,int4,w8a8,w4a8,int4+head]
                              [--json bench/results/quantized.json]

Each setting is an engine of its own on the same checkpoint (the cpu backend, its C kernels);
`KIND+head` quantizes the LM head too (`quantize_lm_head`); w8a8 and w4a8 round the inputs to
int8 per token as well (the integer kernel: AVX-512 VNNI, or AVX2 for int4). All engines are
built first and the decode steps are timed in `--rounds` rounds over every setting in turn (the
median of the rounds' medians), so that a drift in the machine's memory bandwidth (on a shared
VM, 30% between runs minutes apart) falls on every setting alike; the caption and chat jobs run in
the same rounds (new inputs each round, settings in turns, the order reversed every other round;
the median of the rounds).
Bytes a decode step reads: every linear layer's stored weight (the quantized panels and their
scales, the LM head's float32 panels) plus the KV of the batch, over the read bandwidth measured
in the same run. Agreement: over the caption and chat outputs, the share of greedy tokens equal to
fp32's at the same position, and on the chat prompts the mean log-probability the fp32 model gives
the setting's tokens (fp32's own tokens score highest; the gap is the quality proxy).
Host floor (`--floor`, the Qwen benchmark models): the same settings on a twin with the model's
layers and vocabulary at widths of 64 (bench/vlm.py `floor_model_path`), timed in the same rounds;
its step is what the host spends around the kernels. A step's bound is then the roofline plus the
floor, and `of_bound` says how close the setting comes to it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bench import vlm
from bench.machine import machine_info, memory_bytes_per_s
from bench.roofline import step_seconds
from bench.save import save_json
from mm_engine import LLM, SamplingParams
from mm_engine.models.layers.packed_linear import PackedLinear, PanelLinear
from mm_engine.models.layers.quant_linear import QuantLinear


def weight_bytes(lm: nn.Module) -> int:
    """Bytes of every linear layer's weight as the step reads it (not the embedding table)."""
    total = 0
    for m in lm.modules():
        if isinstance(m, QuantLinear):
            if m.a8 is not None:
                parts = (m.a8.weights, m.a8.scales, m.a8.zeros, m.a8.wsum)
            elif m.panels is not None:
                parts = (m.panels.weights, m.panels.scales, m.panels.zeros)
            else:
                parts = (m.weight_q.q, m.weight_q.scales)
            total += sum(t.nbytes for t in parts if t is not None)
        elif isinstance(m, PanelLinear):
            total += m.panels.nbytes
        elif isinstance(m, nn.Linear):
            total += m.weight.nbytes
        elif isinstance(m, PackedLinear):
            total += m.in_features * m.out_features * m.dtype.itemsize
    return total


def text_chat(path: str, question: str) -> str:
    """A text-only chat turn through the checkpoint's template."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": question}]
    return AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def jobs(llm: LLM, path: str, n: int, max_tokens: int, round_: int = 0) -> dict:
    """A caption job (n images) and a text chat job (n questions), greedy; seconds and tokens.
    Each round has inputs of its own (new pictures, the questions numbered), so that a later
    round finds nothing in the encoder and prefix caches."""
    caption_prompt, _ = vlm.prompts_for(path)
    caption = [
        {"prompt": caption_prompt, "multi_modal_data": {"image": img}} for img in vlm.images(n, seed=round_)
    ]
    mark = f"Round {round_}. " if round_ else ""
    chat = [text_chat(path, mark + q) for q in (vlm.CHAT_QUESTIONS * n)[:n]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for name, batch in (("caption", caption), ("chat", chat)):
        t = time.perf_counter()
        res = llm.generate(batch, params)
        seconds = time.perf_counter() - t
        tokens = [list(r.outputs[0].token_ids) for r in res]
        out[name] = {
            "seconds": seconds,
            "tokens": tokens,
            "prompt_ids": [list(r.prompt_token_ids) for r in res],
        }
    return out


def fp32_logprob(llm: LLM, prompt_ids: list[list[int]], outputs: list[list[int]]) -> float:
    """Mean log-probability `llm` gives `outputs` after their prompts (teacher-forced)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    res = llm.generate(
        [{"prompt_token_ids": p + o} for p, o in zip(prompt_ids, outputs, strict=True)], params
    )
    values = []
    for r, p, o in zip(res, prompt_ids, outputs, strict=True):
        scored = r.prompt_logprobs[len(p) : len(p) + len(o)]
        values += [entry[tok].logprob for entry, tok in zip(scored, o, strict=True)]
    return statistics.fmean(values)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def cell(step: dict, base: dict) -> str:
    of = step.get("of_bound", step["of_roofline"])
    return f"{step['ms']:9.2f} ({base['ms'] / step['ms']:4.2f}x, {of:4.0%})".rjust(30)


def engine(path: str, setting: str, seats: int, kv_bytes: int) -> LLM:
    """The cpu backend's engine of `setting` ("int4+head": the LM head quantized too), warmed up."""
    kind, _, head = setting.partition("+")
    # No snapshot rows: they would take state slots, hence seats, and prefix reuse is not timed.
    llm = LLM(path, attention_backend="cpu", quantization=None if kind == "fp32" else kind,
              quantize_lm_head=head == "head", max_num_seqs=seats, kv_cache_memory_bytes=kv_bytes,
              num_state_snapshots=0)  # fmt: skip
    step_seconds(llm, 1, 16, 4, seed=99)  # warm-up: first-touch of the KV memory
    return llm


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-qwen2.5-vl")
    ap.add_argument("--settings", default="fp32,bf16,fp8,int8,int4,int8+head,int4+head")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size (median)")
    ap.add_argument("--jobs", type=int, default=4, help="images and questions in the caption and chat jobs")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of decode-step timing over the settings")
    ap.add_argument("--kv-gib", type=float, default=1.5, help="KV (and state) memory of each engine")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the host floor on the model's width-64 twin (Qwen benchmark models)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.jobs < 1:  # the agreement and the jobs' ratios need tokens from each setting
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    torch.set_num_threads(args.threads)
    path = vlm.resolve_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = memory_bytes_per_s()
    settings = args.settings.split(",")
    seats = max(batches)
    engines = {s: engine(path, s, seats, int(args.kv_gib * 1024**3)) for s in settings}
    twin = vlm.floor_model_path(args.model) if args.floor else None
    floors = {s: engine(str(twin), s, seats, 256 * 1024**2) for s in settings} if twin else {}
    medians: dict[str, dict[int, list[float]]] = {s: {b: [] for b in batches} for s in settings}
    floor_medians: dict[str, dict[int, list[float]]] = {s: {b: [] for b in batches} for s in floors}
    done: dict[str, list[dict]] = {s: [] for s in settings}  # the jobs, per setting and round
    for r in range(args.rounds):
        for setting in settings:
            for b in batches:
                times = step_seconds(engines[setting], b, args.context, args.steps, seed=b)
                medians[setting][b].append(statistics.median(times))
                if setting in floors:
                    times = step_seconds(floors[setting], b, args.context, args.steps, seed=b)
                    floor_medians[setting][b].append(statistics.median(times))
        # The jobs in turns too, in the other order every other round (what runs first in a round
        # meets the machine as the one before left it).
        for setting in settings if r % 2 == 0 else settings[::-1]:
            done[setting].append(jobs(engines[setting], path, args.jobs, args.max_tokens, r))
    # The twin's own bytes (its LM head above all) are in the roofline already: not counted twice.
    floor_bytes = {s: weight_bytes(llm.engine.core.model.language_model) for s, llm in floors.items()}
    for llm in floors.values():
        llm.close()
    rows, fp32 = [], None
    for setting in settings:
        llm = engines[setting]
        core = llm.engine.core
        wbytes = weight_bytes(core.model.language_model)
        kv_token = core.kv.spec.bytes_per_block // core.kv.spec.block_size
        steps = {}
        for b in batches:
            med = statistics.median(medians[setting][b])
            bound = (wbytes + b * (args.context + 1) * kv_token) / bandwidth
            steps[b] = {"ms": med * 1e3, "roofline_ms": bound * 1e3, "of_roofline": bound / med,
                        "rounds_ms": [m * 1e3 for m in medians[setting][b]]}  # fmt: skip
            if setting in floor_medians:
                host = statistics.median(floor_medians[setting][b]) - floor_bytes[setting] / bandwidth
                floor = max(0.0, host)
                steps[b].update(floor_ms=floor * 1e3, bound_ms=(bound + floor) * 1e3)
                steps[b]["of_bound"] = (bound + floor) / med
        job_s = {j: [d[j]["seconds"] for d in done[setting]] for j in ("caption", "chat")}
        row = {"setting": setting, "weight_bytes": wbytes, "compute": core.platform.quantized_compute(),
               "steps": steps, "caption_s": statistics.median(job_s["caption"]),
               "chat_s": statistics.median(job_s["chat"]), "rounds_caption_s": job_s["caption"],
               "rounds_chat_s": job_s["chat"]}  # fmt: skip
        first = done[setting][0]  # agreement: the first round's outputs, the same inputs for all
        if fp32 is None:
            fp32 = (llm, first)
        else:
            ref_llm, ref = fp32
            tokens = [first[j]["tokens"] for j in ("caption", "chat")]
            row["agreement"] = agreement(sum(tokens, []), ref["caption"]["tokens"] + ref["chat"]["tokens"])
            row["fp32_logprob"] = fp32_logprob(ref_llm, ref["chat"]["prompt_ids"], first["chat"]["tokens"])
        rows.append(row)
        if llm is not fp32[0]:
            llm.close()
    rows[0]["agreement"] = 1.0
    rows[0]["fp32_logprob"] = fp32_logprob(fp32[0], fp32[1]["chat"]["prompt_ids"], fp32[1]["chat"]["tokens"])
    base = rows[0]
    print(
        f"{machine_info()['cpu']}, {args.threads} threads, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {args.model}"
    )
    of = "of bound" if floors else "of roofline"
    head = " ".join(f"{'b=' + str(b) + f' ms (x fp32, {of})':>30}" for b in batches)
    floor_head = f" {'floor ms':>14}" if floors else ""
    print(f"{'setting':8} {'weights MB':>10} {head} {'caption':>9} {'chat':>9} {'agree':>6} "
          f"{'logprob':>8}{floor_head}")  # fmt: skip
    for r in rows:
        cells = " ".join(cell(r["steps"][b], base["steps"][b]) for b in batches)
        cap, chat = base["caption_s"] / r["caption_s"], base["chat_s"] / r["chat_s"]
        floor = " " + "/".join(f"{r['steps'][b]['floor_ms']:.1f}" for b in batches) if floors else ""
        print(f"{r['setting']:8} {r['weight_bytes'] / 1e6:10.1f} {cells} {cap:8.2f}x {chat:8.2f}x "
              f"{r['agreement']:6.1%} {r['fp32_logprob']:8.3f}{floor:>15}")  # fmt: skip
    result = {"machine": machine_info(), "args": vars(args), "bandwidth_bytes_per_s": bandwidth, "rows": rows}
    if args.json:
        save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
