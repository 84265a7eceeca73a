"""bench.serve --compare A B (and --compare-engine-core, its thread/process case): the same trace
against two server configurations, runs in ABBA order, compared by the mean of each one's runs."""

from __future__ import annotations

COMPARED = ("output_throughput", "request_goodput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
            "p99_itl_ms", "max_itl_ms")  # fmt: skip
BY_KIND = ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms")


def compare(results: dict[str, list[dict]], a: str = "thread", b: str = "process") -> dict:
    """Configuration `b` against `a` on the same trace: each figure (the mean over that one's
    runs), overall and per modality, and b / a."""

    def mean(label: str, group: str, key: str) -> float | None:
        values = [r["metrics"].get(group, {}).get(key) for r in results[label]]
        return None if not values or any(v is None for v in values) else sum(values) / len(values)

    runs = len(results[a])
    print(f"\n## {a!r} vs {b!r} (same trace, {runs} runs each, ABBA)\n")
    print(f"| metric | {a} | {b} | {b} / {a} |\n|---|---:|---:|---:|")
    rows = {}
    cells = [("overall", key) for key in COMPARED] + [(g, k) for g in ("caption", "chat") for k in BY_KIND]
    for group, key in cells:
        x, y = mean(a, group, key), mean(b, group, key)
        if x is None and y is None:
            continue
        ratio = y / x if x and y is not None else None
        name = key if group == "overall" else f"{group} {key}"
        rows[name] = {a: x, b: y, "ratio": ratio}
        text = f"{x:.2f} | {y:.2f} | {ratio:.3f}" if ratio is not None else "- | - | -"
        print(f"| {name} | {text} |")
    return rows
