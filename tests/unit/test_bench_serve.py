"""bench.serve's metrics on hand-made request records, and its trace generator (no server)."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from bench.serve import make_trace
from bench.serve_metrics import RequestRecord, compute_metrics, markdown_table, parse_goodput


def _records() -> list[RequestRecord]:
    return [
        # TPOT (0.5 - 0.1) / (5 - 1) = 0.1 s
        RequestRecord(
            "caption", True, ttft=0.1, latency=0.5, itl=[0.1] * 4, prompt_tokens=200, output_tokens=5
        ),
        # TPOT (1.3 - 0.3) / (11 - 1) = 0.1 s; its image was cached
        RequestRecord("chat", True, 0.3, 1.3, [0.1] * 10, 210, 11, cached_tokens=196),
        RequestRecord("chat", False, error="HTTP 503"),
        # one output token: no TPOT sample, and TPOT 0 for goodput
        RequestRecord("chat", True, ttft=0.5, latency=0.5, prompt_tokens=210, output_tokens=1),
    ]


def test_counts_and_throughputs() -> None:
    m = compute_metrics(_records(), duration=2.0, slos_ms={})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"], m["cached_input_tokens"]) == (620, 17, 196)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(8.5)
    assert m["total_token_throughput"] == pytest.approx(318.5)
    assert m["request_goodput"] is None  # no SLOs given


def test_latency_summaries() -> None:
    m = compute_metrics(_records(), duration=2.0, slos_ms={}, percentiles=(50, 99))
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == pytest.approx(300.0)
    assert m["p50_ttft_ms"] == pytest.approx(300.0)
    assert m["p99_ttft_ms"] == pytest.approx(496.0)  # linear interpolation: 300 + 0.98 * 200
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(80000 / 3))
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # the one-token request is left out
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(2300.0 / 3)
    assert m["median_e2el_ms"] == pytest.approx(500.0)


def test_goodput() -> None:
    records = _records()
    # ttft <= 400 ms drops the one-token request; e2el <= 1000 ms drops the long chat one
    assert compute_metrics(records, 2.0, {"ttft": 400, "e2el": 1000})["request_goodput"] == pytest.approx(0.5)
    # tpot <= 50 ms: only the one-token request (TPOT 0) meets it
    assert compute_metrics(records, 2.0, {"tpot": 50})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(records, 2.0, {"ttft": 10_000})["request_goodput"] == pytest.approx(1.5)


def test_empty_group_and_table() -> None:
    empty = compute_metrics([], 2.0, {"ttft": 1000})
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["request_goodput"] == 0.0
    table = markdown_table({"overall": compute_metrics(_records(), 2.0, {}), "caption": empty}, [99])
    assert table.splitlines()[0] == "| metric | overall | caption |"
    assert "| completed | 3 | 0 |" in table
    assert "| mean TTFT (ms) | 300.00 | - |" in table


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:2000", "tpot:200"]) == {"ttft": 2000.0, "tpot": 200.0}
    for bad in (["ttft"], ["latency:5"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _trace_args(**kw) -> argparse.Namespace:
    base = dict(num_prompts=400, request_rate=4.0, burstiness=1.0, caption_fraction=0.5,
                shared_image_fraction=0.3, max_output_tokens=64, seed=0)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_trace_is_seeded_and_shaped() -> None:
    trace, n_images = make_trace(_trace_args())
    assert make_trace(_trace_args()) == (trace, n_images)
    assert trace[0].arrival == 0.0
    gaps = np.diff([t.arrival for t in trace])
    assert (gaps >= 0).all() and gaps.mean() == pytest.approx(0.25, rel=0.2)
    assert 0.4 < sum(t.modality == "caption" for t in trace) / len(trace) < 0.6
    assert 0.6 * len(trace) < n_images < 0.8 * len(trace)
    assert max(t.image for t in trace) == n_images - 1 and max(t.max_tokens for t in trace) <= 64
    # a shared image was used before: each first use comes in order
    seen = -1
    for t in trace:
        assert t.image <= seen + 1
        seen = max(seen, t.image)
    burst, _ = make_trace(_trace_args(request_rate=float("inf")))
    assert all(t.arrival == 0.0 for t in burst)
