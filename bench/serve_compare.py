"""bench.serve --compare-engine-core: the same trace against the engine core on a thread and in its
own process, runs in ABBA order, compared by the mean of each mode's runs."""

from __future__ import annotations

COMPARED = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def compare(results: dict[str, list[dict]]) -> dict:
    """Thread against process on the same trace: each figure (the mean over that mode's runs),
    and process / thread."""

    def mean(mode: str, key: str) -> float | None:
        values = [r["metrics"]["overall"].get(key) for r in results[mode]]
        return None if any(v is None for v in values) else sum(values) / len(values)

    runs = len(results["thread"])
    print(f"\n## engine core on a thread vs in its own process (same trace, {runs} runs each, ABBA)\n")
    print("| metric | thread | process | process / thread |\n|---|---:|---:|---:|")
    rows = {}
    for key in COMPARED:
        a, b = mean("thread", key), mean("process", key)
        ratio = b / a if a and b is not None else None
        rows[key] = {"thread": a, "process": b, "ratio": ratio}
        cells = f"{a:.2f} | {b:.2f} | {ratio:.3f}" if ratio is not None else "- | - | -"
        print(f"| {key} | {cells} |")
    return rows
