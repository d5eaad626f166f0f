"""Prometheus metrics of ``memfit serve`` (GET /metrics): queue, batches, latency and memory vs the budget.

Each server gets its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from memfit.memory.model import process_peak_rss_bytes
from memfit.serve.batcher import BatchObserver

_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


class ServerMetrics(BatchObserver):
    """The server's metrics; the batcher reports into it as its :class:`BatchObserver`."""

    def __init__(self, budget_bytes: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_windows = Gauge("memfit_queue_windows", "Windows waiting for a batch", registry=r)
        self.queue_tokens = Gauge("memfit_queue_tokens", "Tokens waiting for a batch", registry=r)
        self.admitted_tokens = Gauge(
            "memfit_admitted_tokens",
            "Queue tokens held by admitted requests (queued, running or answering)",
            registry=r,
        )
        self.batch_tokens = Histogram(
            "memfit_batch_tokens", "Padded tokens per batch (batch x padded length)", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_windows = Histogram(
            "memfit_batch_windows",
            "Windows per batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "memfit_batch_seconds", "Model time per batch", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("memfit_tokens", "Tokens run through the model (padding excluded)", registry=r)
        self.dropped_windows = Counter(
            "memfit_dropped_windows", "Queued windows dropped because their client left", registry=r
        )
        self.request_seconds = Histogram(
            "memfit_request_seconds", "Request latency by route", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("memfit_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.rejected = Counter("memfit_rejected_requests", "Requests refused by a limit", ["reason"], registry=r)
        Gauge("memfit_memory_budget_bytes", "The --memory-budget", registry=r).set(budget_bytes)
        Gauge("memfit_peak_rss_bytes", "Peak resident set of the server process (VmHWM)", registry=r).set_function(
            process_peak_rss_bytes
        )

    # -- BatchObserver ----------------------------------------------------------------------------

    def queued(self, windows: int, tokens: int) -> None:
        self.queue_windows.set(windows)
        self.queue_tokens.set(tokens)

    def batch(self, windows: int, padded_tokens: int, real_tokens: int, seconds: float) -> None:
        self.batch_windows.observe(windows)
        self.batch_tokens.observe(padded_tokens)
        self.batch_seconds.observe(seconds)
        self.tokens.inc(real_tokens)

    def dropped(self, windows: int) -> None:
        self.dropped_windows.inc(windows)

    def render(self) -> bytes:
        return generate_latest(self.registry)
