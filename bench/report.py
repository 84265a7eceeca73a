"""Turn the benchmarks' JSON into PNG plots for README (matplotlib, no display needed).

    python -m bench.report [--results bench/results]

Reads whichever of offline_caption.json, offline_chat.json (and their GPU runs,
offline_*_gpu.json), serve.json, memory.json, roofline.json and kernels.json exist in the folder
and writes one PNG next to each; every plot's title carries the date and the machine the figures
were measured on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

ENGINE, HF = "#1f77b4", "#ff7f0e"


def _stamp(result: dict) -> str:
    machine = result.get("machine") or result.get("inputs", {}).get("machine", {})
    if "gpu" in machine and result.get("device", "cpu") != "cpu":
        return f"{machine.get('date', '?')}, {machine['gpu']}, {result.get('dtype', '?')}"
    return (
        f"{machine.get('date', '?')}, {machine.get('cpu', '?')}, {machine.get('torch_threads', '?')} threads"
    )


def plot_offline(runs: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.8), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        vals = [r["engine_images_per_s"], r["hf_images_per_s"]]
        bars = ax.bar(["mm-engine", f"transformers\n(batch {r['hf_batch_size']})"], vals, color=[ENGINE, HF])
        fracs = [r["compute_floor_fraction"], r["hf_compute_floor_fraction"]]
        for bar, frac in zip(bars, fracs, strict=True):
            ax.annotate(
                f"{frac:.0%} of\ncompute floor",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylim(0, max(vals) * 1.3)
        ax.set_ylabel("images / s")
        ax.set_title(f"{r['workload']}: {r['throughput_ratio']:.2f}x transformers", fontsize=10)
    _save(fig, out, f"bench.offline ({_stamp(runs[0])})")


def plot_serve(r: dict, out: Path) -> None:
    groups = [g for g in ("caption", "chat", "overall") if g in r["metrics"]]
    names = ("ttft", "tpot", "itl", "e2el")
    fig, axes = plt.subplots(1, len(names), figsize=(14, 3.6))
    for ax, name in zip(axes, names, strict=True):
        for k, stat in enumerate(("median", "p99")):
            vals = [r["metrics"][g].get(f"{stat}_{name}_ms") or 0.0 for g in groups]
            xs = [i + (k - 0.5) * 0.38 for i in range(len(groups))]
            ax.bar(xs, vals, width=0.38, label=stat, color=[ENGINE, HF][k])
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(f"{name.upper()} (ms)", fontsize=10)
    axes[0].legend(fontsize=8, loc="lower left", framealpha=0.9)
    a = r["args"]
    goodput = r["metrics"]["overall"].get("request_goodput") or 0
    _save(
        fig,
        out,
        f"bench.serve: {a.get('num_prompts')} requests at {a.get('request_rate')} req/s, "
        f"goodput {goodput:.2f} req/s ({_stamp(r)})",
    )


def plot_memory(r: dict, out: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    pools = list(r["kv_waste"])
    ax1.bar(pools, [100 * r["kv_waste"][p] for p in pools], color=ENGINE)
    ax1.axhline(4, color="grey", ls="--", lw=1)
    ax1.text(len(pools) - 0.5, 4.1, "4% (vLLM paper)", ha="right", va="bottom", fontsize=8)
    ax1.set_ylabel("internal waste (%)")
    ax1.set_title("KV slots allocated but not filled", fontsize=10)
    ours = r.get("seqs_mean", 0)
    ax2.bar(["mm-engine (paged)", "transformers\n(static cache)"], [ours, r["hf_seqs"]], color=[ENGINE, HF])
    ax2.set_ylabel("sequences at once")
    ax2.set_title(f"same KV memory: {r['concurrent_seqs_ratio']:.2f}x", fontsize=10)
    _save(fig, out, f"bench.memory ({_stamp(r)})")


def plot_roofline(r: dict, out: Path) -> None:
    rows = r["rows"]
    b = [x["batch"] for x in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(b, [x["step_ms"] for x in rows], "o-", color=ENGINE, label="measured step")
    ax.plot(b, [x["memory_bound_ms"] for x in rows], "--", color="grey", label="memory bound")
    ax.plot(b, [x["compute_bound_ms"] for x in rows], ":", color="black", label="compute bound")
    for x in rows:
        ax.annotate(
            f"{x['fraction_of_roofline']:.0%}",
            (x["batch"], x["step_ms"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)
    ax.set_title(f"bench.roofline ({_stamp(r)})", fontsize=9)
    _save(fig, out)


def plot_kernels(r: dict, out: Path) -> None:
    """Decode: fraction of copy bandwidth against batch, one line per context; prefill: TFLOP/s."""
    fig, (dec, pre) = plt.subplots(1, 2, figsize=(10, 4))
    decode = [x for x in r["decode"] if "skipped" not in x]
    prefill = [x for x in r["prefill"] if "skipped" not in x]
    for k, ctx in enumerate(sorted({x["context"] for x in decode})):
        rows = [x for x in decode if x["context"] == ctx]
        shade = 0.35 + 0.3 * k
        batches = [x["batch"] for x in rows]
        dec.plot(batches, [x["triton_bw_frac"] for x in rows], "o-", color=ENGINE, alpha=shade,
                 label=f"Triton, context {ctx}")  # fmt: skip
        dec.plot(batches, [x["sdpa_bw_frac"] for x in rows], "s--", color=HF, alpha=shade,
                 label=f"SDPA, context {ctx}")  # fmt: skip
    dec.set_xscale("log", base=2)
    dec.set_xlabel("decode batch size")
    dec.set_ylabel("K/V read rate / copy bandwidth")
    dec.legend(fontsize=7)
    dec.set_title("decode", fontsize=9)
    labels = [f"{x['batch']}x{x['context']}" for x in prefill]
    pos = range(len(prefill))
    pre.bar([i - 0.2 for i in pos], [x["triton_tflops"] for x in prefill], 0.4, color=ENGINE, label="Triton")
    pre.bar([i + 0.2 for i in pos], [x["sdpa_tflops"] for x in prefill], 0.4, color=HF, label="SDPA")
    pre.set_xticks(list(pos), labels, rotation=45, fontsize=7)
    pre.set_xlabel("batch x context (causal prefill)")
    pre.set_ylabel("TFLOP/s")
    pre.legend(fontsize=8)
    pre.set_title("prefill", fontsize=9)
    shape = r["shape"]
    _save(
        fig,
        out,
        f"bench.kernels ({r.get('date', '?')}, {r['device']}, {shape['dtype']}, {shape['num_heads']} heads / "
        f"{shape['num_kv_heads']} KV heads x {shape['head_dim']}, copy {r['copy_bandwidth_gbs']:.0f} GB/s)",
    )


def _save(fig, out: Path, title: str | None = None) -> None:
    """Write the figure with the figure-wide title (date and machine), when given, and close it."""
    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    d = args.results

    def load(name: str) -> dict | None:
        path = d / name
        return json.loads(path.read_text()) if path.is_file() else None

    written = []
    for suffix in ("", "_gpu"):
        offline = [
            r for r in (load(f"offline_caption{suffix}.json"), load(f"offline_chat{suffix}.json")) if r
        ]
        if offline:
            plot_offline(offline, d / f"offline{suffix}.png")
            written.append(d / f"offline{suffix}.png")
    plots = (
        ("serve", plot_serve),
        ("memory", plot_memory),
        ("roofline", plot_roofline),
        ("kernels", plot_kernels),
    )
    for name, fn in plots:
        r = load(f"{name}.json")
        if r:
            fn(r, d / f"{name}.png")
            written.append(d / f"{name}.png")
    if not written:
        raise SystemExit(f"no benchmark JSON found in {d}")
    return written


if __name__ == "__main__":
    main()
