"""Prometheus metrics, named from ``kembed.contract`` (the operator's autoscaling reads them).

Gauges that describe the present (drain time, P95, backlog, rate) are computed at scrape time
from the live state, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kembed.contract import Metric

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_SIZE_BUCKETS = tuple(float(1 << i) for i in range(13))
BATCH_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(4, 20))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            Metric.REQUEST_DURATION_SECONDS,
            "Server-side latency of answered requests",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(Metric.REQUESTS, "Requests by gRPC status code", ["code"], registry=r)
        self.rejected = Counter(Metric.REJECTED, "Requests rejected by admission control", ["reason"], registry=r)
        self.batch_size = Histogram(Metric.BATCH_SIZE, "Rows per batch", registry=r, buckets=BATCH_SIZE_BUCKETS)
        self.batch_tokens = Histogram(
            Metric.BATCH_TOKENS, "Padded tokens per batch", registry=r, buckets=BATCH_TOKEN_BUCKETS
        )
        self.tokens = Counter(Metric.TOKENS, "Tokens computed, real or padding", ["kind"], registry=r)
        self.inference_seconds = Histogram(
            Metric.INFERENCE_SECONDS, "Worker compute time per batch", registry=r, buckets=LATENCY_BUCKETS
        )
        self.queue_drain = Gauge(Metric.QUEUE_DRAIN_SECONDS, "Estimated time to drain the backlog", registry=r)
        self.latency_p95 = Gauge(Metric.LATENCY_P95_SECONDS, "P95 server-side latency, sliding window", registry=r)
        self.queued_tokens = Gauge(Metric.QUEUED_TOKENS, "Padded tokens queued or in flight", registry=r)
        self.service_rate = Gauge(Metric.SERVICE_RATE, "Measured padded tokens per compute second", registry=r)
        self.worker_queue_depth = Gauge(Metric.WORKER_QUEUE_DEPTH, "Batches handed to the worker", registry=r)
        self.ready = Gauge(Metric.READY, "1 when warm and accepting requests", registry=r)
        for kind in ("real", "padding"):
            self.tokens.labels(kind=kind)

    def bind(
        self,
        *,
        drain_seconds: Callable[[], float],
        p95_seconds: Callable[[], float],
        queued_tokens: Callable[[], float],
        service_rate: Callable[[], float],
        worker_queue_depth: Callable[[], float],
        ready: Callable[[], float],
    ) -> None:
        self.queue_drain.set_function(drain_seconds)
        self.latency_p95.set_function(p95_seconds)
        self.queued_tokens.set_function(queued_tokens)
        self.service_rate.set_function(service_rate)
        self.worker_queue_depth.set_function(worker_queue_depth)
        self.ready.set_function(ready)

    def observe_batch(self, rows: int, padded_tokens: int, real_tokens: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.batch_tokens.observe(padded_tokens)
        self.tokens.labels(kind="real").inc(real_tokens)
        self.tokens.labels(kind="padding").inc(padded_tokens - real_tokens)
        self.inference_seconds.observe(seconds)
