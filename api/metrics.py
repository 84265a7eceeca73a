"""Prometheus metrics under `mm_engine:`, named after vLLM's (`vllm:`) where one exists.

`Metrics` is the engine's `StatsListener`, given to the engine when it is built: request timings
are observed by the engine's output thread as outputs come out (prometheus-client is thread-safe).
Gauges and engine counters come from the engine's latest `stats()`, which the route hands to
`render` at scrape time.
Each app has its own registry, so several apps can live in one process (tests). With several API
servers (`--api-server-count`) the request metrics add up over them (prometheus-client's
multiprocess mode).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from mm_engine.outputs import RequestOutput

P = "mm_engine:"
POOLS = ("text", "image")
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_FILL = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class _EngineCollector(Collector):
    """Gauges and the engine's own counters, from one stats snapshot and the platform info."""

    def __init__(self, stats: dict, platform: dict) -> None:
        self.stats, self.platform = stats, platform

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily(P + "num_requests_running", "Requests in the running batch.",
                                value=s.get("num_requests_running", 0))  # fmt: skip
        yield GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting to be scheduled.",
                                value=s.get("num_requests_waiting", 0))  # fmt: skip
        usage = GaugeMetricFamily(
            P + "kv_cache_usage_perc", "Fraction of the pool's KV blocks in use (0 to 1).", labels=["pool"]
        )
        for pool in POOLS:
            usage.add_metric([pool], s.get("kv_cache_usage_perc", {}).get(pool, 0.0))
        yield usage
        if s.get("state_slots_total"):  # a hybrid model
            used, total = s.get("state_slots_used", 0), s["state_slots_total"]
            doc = "Fraction of the recurrent-state slots in use (0 to 1)."
            yield GaugeMetricFamily(P + "state_slots_usage_perc", doc, value=used / total)
        for key, doc in (
            ("prefix_cache_queries", "Blocks looked up in the prefix cache."),
            ("prefix_cache_hits", "Blocks found in the prefix cache."),
        ):
            fam = CounterMetricFamily(P + key, doc, labels=["pool"])
            for pool in POOLS:
                fam.add_metric([pool], s.get(key + "_total", {}).get(pool, 0))
            yield fam
        yield CounterMetricFamily(P + "encoder_cache_hits", "Images whose encoder output was cached.",
                                  value=s.get("encoder_cache_hits_total", 0))  # fmt: skip
        for key, doc in (
            ("encoded_inputs", "Images and clips the vision tower encoded, by modality."),
            ("encoded_tokens", "Vision tokens the tower produced, by modality (image, video)."),
        ):
            fam = CounterMetricFamily(P + key, doc, labels=["modality"])
            for modality in ("image", "video"):
                fam.add_metric([modality], s.get(key + "_total", {}).get(modality, 0))
            yield fam
        yield CounterMetricFamily(P + "num_preemptions", "Requests preempted (recompute or swap).",
                                  value=s.get("num_preemptions_total", 0))  # fmt: skip
        yield from _per_core(s.get("per_core", []))
        info = self.platform
        kernels = GaugeMetricFamily(
            P + "cpu_kernels_info", "The CPU C kernels in use: ISA variant and kernel names (1).",
            labels=["variant", "kernels", "attention_backend"],
        )  # fmt: skip
        variant = info["cpu_variant"] or "none"
        kernels.add_metric([variant, ",".join(info["cpu_kernels"]), info["attention_backend"]], 1.0)
        yield kernels


def _per_core(per_core: list[dict]):
    """With several engine cores (--data-parallel-size): each one's gauges, labelled by core."""
    running = GaugeMetricFamily(P + "core_num_requests_running", "Running requests, per engine core.",
                                labels=["core"])  # fmt: skip
    waiting = GaugeMetricFamily(P + "core_num_requests_waiting", "Waiting requests, per engine core.",
                                labels=["core"])  # fmt: skip
    usage = GaugeMetricFamily(P + "core_kv_cache_usage_perc", "KV pool usage (0 to 1), per engine core.",
                              labels=["core", "pool"])  # fmt: skip
    for i, s in enumerate(per_core):
        running.add_metric([str(i)], s.get("num_requests_running", 0))
        waiting.add_metric([str(i)], s.get("num_requests_waiting", 0))
        for pool in POOLS:
            usage.add_metric([str(i), pool], s.get("kv_cache_usage_perc", {}).get(pool, 0.0))
    yield from (running, waiting, usage)


class Metrics:
    """The request metrics' registry and the engine's `StatsListener` (`listener=` when the engine
    is built); `max_num_seqs` is the engine's, for the batch fill ratio."""

    def __init__(self, max_num_seqs: int) -> None:
        self.registry = CollectorRegistry()
        # One of several API servers (PROMETHEUS_MULTIPROC_DIR, set by api/supervisor.py): the
        # request metrics go to files that every server's scrape adds up; the engine's own come
        # from the cores, whose stats reach every server alike.
        multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        r = None if multiprocess else self.registry
        self.max_num_seqs = max_num_seqs
        by = ["modality"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token.", by,
                              buckets=_LATENCY, registry=r)  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between two tokens of a request.", by,
                             buckets=_ITL, registry=r)  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", by,
                             buckets=_E2E, registry=r)  # fmt: skip
        self.queue = Histogram(P + "request_queue_time_seconds", "Time waiting before first scheduled.", by,
                               buckets=_E2E, registry=r)  # fmt: skip
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(P + "request_success", "Requests ended, by reason (stop, length, abort).",
                               ["finished_reason"], registry=r)  # fmt: skip
        self.step = Histogram(P + "scheduler_step_seconds", "Wall time of one engine step.",
                              buckets=_STEP, registry=r)  # fmt: skip
        self.fill = Histogram(P + "batch_fill_ratio", "Running requests over max_num_seqs, per step.",
                              buckets=_FILL, registry=r)  # fmt: skip
        if multiprocess:
            MultiProcessCollector(self.registry)
        # Every series exists from the start (at 0), so rates and dashboards work before traffic.
        for reason in ("stop", "length", "abort"):
            self.success.labels(reason)
        for hist in (self.ttft, self.itl, self.e2e, self.queue):
            for modality in ("image", "text"):
                hist.labels(modality)

    def render(self, stats: dict, platform: dict) -> bytes:
        """The exposition text: request metrics, then the engine's from its `stats` snapshot."""
        engine = CollectorRegistry(auto_describe=False)
        engine.register(_EngineCollector(stats, platform))
        return generate_latest(self.registry) + generate_latest(engine)

    # ---- StatsListener (engine thread) -------------------------------------------------------------

    def on_step(self, seconds: float, num_outputs: int, stats: dict) -> None:
        self.step.observe(seconds)
        self.fill.observe(min(1.0, stats.get("num_requests_running", 0) / self.max_num_seqs))

    def on_output(self, out: RequestOutput, modality: str, new_tokens: int, itl: float | None) -> None:
        self.generation_tokens.inc(new_tokens)
        if itl is not None:
            self.itl.labels(modality).observe(itl)

    def on_finished(self, out: RequestOutput, modality: str, arrival_time: float) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.success.labels(out.outputs[0].finish_reason or "stop").inc()
        if m.first_token_time is not None:
            self.ttft.labels(modality).observe(max(0.0, m.first_token_time - arrival_time))
        if m.finished_time is not None:
            self.e2e.labels(modality).observe(max(0.0, m.finished_time - arrival_time))
        if m.first_scheduled_time is not None:
            self.queue.labels(modality).observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def on_aborted(self, modality: str) -> None:
        self.success.labels("abort").inc()
