"""Prometheus metrics of the server, through prometheus_client, under vLLM's names where vLLM
has one so that existing dashboards work (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:time_to_first_token_seconds`, ...); the rest are `autoopt:*`, and HTTP status counts are
`http_requests_total{handler, method, status}` as prometheus-fastapi-instrumentator names them.

Request-level series (tokens, latencies, finishes) are recorded by the HTTP layer as requests
run; the engine's gauges (queue lengths, KV usage, preemptions) are read from `engine.stats()`
at scrape time. Every server has its own registry, so several apps can live in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets in seconds: sub-millisecond ITL on a GPU up to minute-long requests on a CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# Engine statistic -> (metric, kind, help). The first of the keys the stats carry is used
# (EngineStats names, or the short names a test engine reports).
_ENGINE_SERIES = (
    (("num_running", "running"), "vllm:num_requests_running", "gauge",
     "Number of requests in the running batch."),
    (("num_waiting", "waiting"), "vllm:num_requests_waiting", "gauge",
     "Number of requests waiting to be scheduled."),
    (("kv_usage", "kv_cache_usage"), "vllm:kv_cache_usage_perc", "gauge",
     "KV-cache usage: 1 means 100 percent (the fuller page pool)."),
    (("num_preemptions",), "vllm:num_preemptions", "counter",
     "Cumulative number of preemptions (requests whose KV pages were taken back)."),
    (("kv_capacity_tokens", "capacity_tokens"), "autoopt:kv_cache_capacity_tokens", "gauge",
     "Tokens of context the KV cache holds."),
)


def stats_dict(stats: Any) -> dict[str, Any]:
    """An engine's stats object (dataclass, dict or plain object) as a dict."""
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    if isinstance(stats, dict):
        return dict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


class EngineCollector(Collector):
    """Engine gauges and counters, read from `engine.stats()` when scraped."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = {"model_name": self.model_name}
        alive = getattr(self.engine, "is_running", True) is not False
        healthy = GaugeMetricFamily("autoopt:engine_healthy",
                                    "1 while the engine serves, 0 once it has stopped on an error.",
                                    labels=list(labels))
        healthy.add_metric(list(labels.values()), 1.0 if alive else 0.0)
        yield healthy
        try:
            stats = stats_dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine did
            return
        for keys, name, kind, help_text in _ENGINE_SERIES:
            key = next((k for k in keys if isinstance(stats.get(k), int | float)), None)
            if key is None:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_text, labels=list(labels))
            family.add_metric(list(labels.values()), float(stats[key]))
            yield family


class ServerMetrics:
    """What the HTTP layer records; `render()` is the /metrics body."""

    def __init__(self, model_name: str = "", engine: Any = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.", m,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", m,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Time from request arrival to its end.", m, buckets=E2E_BUCKETS,
                             registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     m, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m,
                                         registry=reg)
        self.request_prompt = Histogram("vllm:request_prompt_tokens",
                                        "Prompt tokens per finished request.", m,
                                        buckets=TOKEN_BUCKETS, registry=reg)
        self.request_generation = Histogram("vllm:request_generation_tokens",
                                            "Generated tokens per finished request.", m,
                                            buckets=TOKEN_BUCKETS, registry=reg)
        self.success = Counter("vllm:request_success",
                               "Finished requests by finish reason (stop, length, abort, error).",
                               ["model_name", "finished_reason"], registry=reg)
        self.finished = Counter("autoopt:requests_finished",
                                "Finished requests by endpoint and finish reason.",
                                ["model_name", "endpoint", "finished_reason"], registry=reg)
        self.http = Counter("http_requests", "HTTP responses by handler, method and status code "
                            "(499: the client went away before the answer).",
                            ["handler", "method", "status"], registry=reg)
        if engine is not None:
            reg.register(EngineCollector(engine, model_name))

    def first_token(self, arrival: float, now: float) -> None:
        self.ttft.labels(self.model_name).observe(now - arrival)

    def tokens(self, n: int, gap: float | None, now: float) -> None:
        """`n` tokens arrived together, `gap` seconds after the previous ones (None: first)."""
        self.generation_tokens.labels(self.model_name).inc(n)
        if gap is not None and n > 0:
            for _ in range(n):  # a multi-token step spreads its gap over its tokens
                self.itl.labels(self.model_name).observe(gap / n)

    def finish(self, endpoint: str, reason: str, prompt_tokens: int, completion_tokens: int,
               elapsed: float) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.request_prompt.labels(m).observe(prompt_tokens)
        self.request_generation.labels(m).observe(completion_tokens)
        self.success.labels(m, reason).inc()
        self.finished.labels(m, endpoint, reason).inc()
        self.e2e.labels(m).observe(elapsed)

    def response(self, handler: str, method: str, status: int) -> None:
        self.http.labels(handler, method, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
