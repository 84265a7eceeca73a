"""Metrics of `bench.serve`, defined as `vllm bench serve` defines them, so the numbers compare.

Per successful request: TTFT (request sent -> first chunk with content), TPOT ((E2EL - TTFT) /
(output tokens - 1), only for requests with more than one output token), ITL (every gap between
successive content chunks) and E2EL (request sent -> last byte). Each is summarised as mean,
median, standard deviation and the chosen percentiles, in milliseconds. Throughputs divide by the
wall-clock duration of the whole replay; goodput counts only the requests that meet every
service-level objective (a request with one output token has TPOT 0 there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


@dataclass(slots=True)
class RequestRecord:
    """One replayed request; times in seconds from the moment it was sent."""

    modality: str  # "caption" or "chat"
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    finish_reason: str | None = None
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft:2000", "tpot:200"]` -> `{"ttft": 2000.0, "tpot": 200.0}` (milliseconds)."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_NAMES}, got {spec!r}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {value}")
        slos[name] = ms
    return slos


def _summary(name: str, seconds: list[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    ms = np.asarray(seconds, dtype=float) * 1000.0
    stats: dict[str, float | None] = {
        f"mean_{name}_ms": float(ms.mean()) if ms.size else None,
        f"median_{name}_ms": float(np.median(ms)) if ms.size else None,
        f"std_{name}_ms": float(ms.std()) if ms.size else None,
        f"max_{name}_ms": float(ms.max()) if ms.size else None,
    }
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return stats


def _meets(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    slos_ms: dict[str, float],
    percentiles: Sequence[float] = (99,),
) -> dict[str, float | int | None]:
    """The vllm-bench-serve metric set over `records`, which ran in `duration` seconds."""
    ok = [r for r in records if r.success]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    good = sum(_meets(r, slos_ms) for r in ok)
    m: dict[str, float | int | None] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos_ms else None,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        m.update(_summary(name, values, percentiles))
    return m


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def markdown_table(groups: dict[str, dict], percentiles: Sequence[float]) -> str:
    """One column per group (overall, caption, chat), one row per metric."""
    rows = [
        ("completed", "completed"),
        ("failed", "failed"),
        ("request throughput (req/s)", "request_throughput"),
        ("goodput (req/s)", "request_goodput"),
        ("output token throughput (tok/s)", "output_throughput"),
        ("total token throughput (tok/s)", "total_token_throughput"),
        ("input tokens / cached", None),
    ]
    stats = ["mean", "median", *(f"p{p:g}" for p in percentiles)]
    rows += [(f"{stat} {label} (ms)", f"{stat}_{key}_ms") for key, label in LATENCIES for stat in stats]
    lines = ["| metric | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for label, key in rows:
        if key is None:
            cells = [f"{g['total_input_tokens']} / {g['cached_input_tokens']}" for g in groups.values()]
        else:
            cells = [_fmt(g[key]) for g in groups.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
