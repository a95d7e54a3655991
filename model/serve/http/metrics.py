"""Prometheus metrics of the HTTP server, in the text exposition format (written by hand).

prometheus_client is not a dependency; the format is small: `# HELP`, `# TYPE`, then samples.
All updates happen on the server's event loop, so no locking is needed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from typing import Any

PREFIX = "autoopt_serve"
# Latency buckets in seconds: sub-millisecond ITL on a GPU up to minute-long requests on a CPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0

# Engine stats under the names dashboards look for; other numeric stats export as engine_<key>.
_WELL_KNOWN = {
    "num_requests_running": (("running", "num_running", "num_requests_running"),
                             "Requests in the running batch."),
    "num_requests_waiting": (("waiting", "num_waiting", "num_requests_waiting"),
                             "Requests queued for admission."),
    "kv_cache_usage_ratio": (("kv_usage", "kv_cache_usage", "kv_cache_usage_ratio"),
                             "Fraction of KV-cache pages in use (0..1)."),
    "kv_cache_capacity_tokens": (("capacity_tokens", "kv_capacity_tokens", "capacity"),
                                 "Tokens of KV-cache capacity."),
}


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) + ".0"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help = name, help_text
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def stats_dict(stats: Any) -> dict[str, Any]:
    """An engine's stats object (dataclass, dict or plain object) as a dict."""
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    if isinstance(stats, dict):
        return dict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


class Metrics:
    """Request-level counters and latency histograms; engine gauges are read at scrape time."""

    def __init__(self) -> None:
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              TTFT_BUCKETS)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from request arrival to its last token.", E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[tuple[str, str], int] = {}
        self.errors: dict[int, int] = {}
        self._recent: deque[tuple[float, int]] = deque()

    def first_token(self, arrival: float, now: float) -> None:
        self.ttft.observe(now - arrival)

    def tokens(self, n: int, gap: float | None, now: float) -> None:
        """`n` tokens arrived together, `gap` seconds after the previous ones (None: first)."""
        self.generation_tokens += n
        if gap is not None and n > 0:
            for _ in range(n):  # a multi-token step spreads its gap over its tokens
                self.itl.observe(gap / n)
        self._recent.append((now, n))

    def finish(self, endpoint: str, reason: str, prompt_tokens: int, arrival: float) -> None:
        self.prompt_tokens += prompt_tokens
        key = (endpoint, reason)
        self.finished[key] = self.finished.get(key, 0) + 1
        self.e2e.observe(time.monotonic() - arrival)

    def error(self, status: int) -> None:
        self.errors[status] = self.errors.get(status, 0) + 1

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self, engine_stats: Any = None) -> str:
        lines: list[str] = []

        def sample(name: str, kind: str, help_text: str, value: float) -> None:
            full = f"{PREFIX}_{name}"
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}",
                          f"{full} {_fmt(value)}"])

        raw = stats_dict(engine_stats)
        stats = {k: v for k, v in raw.items()
                 if isinstance(v, int | float) and not isinstance(v, bool)}
        used: set[str] = set()
        for name, (keys, help_text) in _WELL_KNOWN.items():
            key = next((k for k in keys if k in stats), None)
            if key is not None:
                used.add(key)
                sample(name, "gauge", help_text, stats[key])
        for key in sorted(set(stats) - used):
            kind = "counter" if key.endswith("_total") else "gauge"
            sample(f"engine_{key}", kind, f"Engine statistic {key}.", stats[key])
        for key, value in sorted(raw.items()):  # labelled counters, e.g. finishes by reason
            if isinstance(value, dict) and key.endswith("_total") and value:
                full = f"{PREFIX}_engine_{key}"
                lines += [f"# HELP {full} Engine statistic {key}.", f"# TYPE {full} counter"]
                label = "finish_reason" if "finished" in key else "key"
                lines += [f'{full}{{{label}="{_escape(str(k))}"}} {_fmt(v)}'
                          for k, v in sorted(value.items())]
        sample("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               self.prompt_tokens)
        sample("generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens)
        sample("generation_tokens_per_second", "gauge",
               f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
               self.tokens_per_second())
        full = f"{PREFIX}_requests_finished_total"
        lines += [f"# HELP {full} Finished requests by endpoint and finish reason.",
                  f"# TYPE {full} counter"]
        for (endpoint, reason), n in sorted(self.finished.items()):
            lines.append(f'{full}{{endpoint="{_escape(endpoint)}",'
                         f'finish_reason="{_escape(reason)}"}} {n}')
        full = f"{PREFIX}_request_errors_total"
        lines += [f"# HELP {full} Requests answered with an HTTP error, by status.",
                  f"# TYPE {full} counter"]
        lines += [f'{full}{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())]
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        return "\n".join(lines) + "\n"
