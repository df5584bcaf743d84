"""Prometheus metrics, named from ``kembed.contract`` (the operator's autoscaling reads them).

Every process of the server counts what it sees in prometheus-client's multiprocess mode (the
supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a folder of its own before starting them): front
ends count requests, their latency and their pre-screen rejections; the engine counts its own
rejections and its batches. The supervisor serves ``/metrics``: those files, merged, plus gauges
of the present (drain time, P95, backlog, rate) read off the engine's board at scrape time, so
they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kembed.board import Board, Cell
from kembed.contract import Metric

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_SIZE_BUCKETS = tuple(float(1 << i) for i in range(13))
BATCH_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(4, 20))


def _rejected(registry: CollectorRegistry) -> Counter:
    return Counter(Metric.REJECTED, "Requests rejected by admission control", ["reason"], registry=registry)


class FrontendMetrics:
    def __init__(self) -> None:
        r = CollectorRegistry()
        self.request_duration = Histogram(
            Metric.REQUEST_DURATION_SECONDS,
            "Server-side latency of answered requests",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(
            Metric.REQUESTS,
            "Answers by API (grpc, rest) and its status code (gRPC's name, HTTP's number)",
            ["api", "code"],
            registry=r,
        )
        self.rejected = _rejected(r)
        self.pushback_waits = Counter(
            Metric.PUSHBACK_WAITS, "Calls that came within their connection's pushback and waited it out", registry=r
        )
        self.stream_answers_dropped = Counter(
            Metric.STREAM_ANSWERS_DROPPED,
            "EmbedStream answers computed but never written: the drain ended before the client read them",
            registry=r,
        )


class EngineMetrics:
    def __init__(self) -> None:
        r = CollectorRegistry()
        self.rejected = _rejected(r)
        self.batch_size = Histogram(Metric.BATCH_SIZE, "Rows per batch", registry=r, buckets=BATCH_SIZE_BUCKETS)
        self.batch_tokens = Histogram(
            Metric.BATCH_TOKENS, "Padded tokens per batch", registry=r, buckets=BATCH_TOKEN_BUCKETS
        )
        self.tokens = Counter(Metric.TOKENS, "Tokens computed, real or padding", ["kind"], registry=r)
        self.inference_seconds = Histogram(
            Metric.INFERENCE_SECONDS, "Worker compute time per batch", registry=r, buckets=LATENCY_BUCKETS
        )
        self.frontend_stalls = Counter(
            Metric.FRONTEND_STALLS,
            "Times the engine stopped reading a front end's work because it had left its answers unread",
            registry=r,
        )
        self._real_tokens = self.tokens.labels(kind="real")
        self._padding_tokens = self.tokens.labels(kind="padding")

    def observe_batch(self, rows: int, padded_tokens: int, real_tokens: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.batch_tokens.observe(padded_tokens)
        self._real_tokens.inc(real_tokens)
        self._padding_tokens.inc(padded_tokens - real_tokens)
        self.inference_seconds.observe(seconds)


class BoardGauges(Collector):
    """Gauges of the present, read off the engine's board at scrape time."""

    def __init__(self, board: Board, ready: Callable[[], bool]) -> None:
        self._gauges: list[tuple[str, str, Callable[[], float]]] = [
            (Metric.QUEUE_DRAIN_SECONDS, "Estimated time to drain the backlog", lambda: drain_seconds(board)),
            (Metric.LATENCY_P95_SECONDS, "P95 server-side latency, sliding window", lambda: board[Cell.P95_SECONDS]),
            (Metric.QUEUED_TOKENS, "Padded tokens queued or in flight", lambda: board[Cell.BACKLOG_TOKENS]),
            (
                Metric.SERVICE_RATE,
                "Measured padded tokens per compute second",
                lambda: board[Cell.TOKENS_PER_SECOND],
            ),
            (Metric.WORKER_QUEUE_DEPTH, "Batches handed to the worker", lambda: board[Cell.IN_FLIGHT_BATCHES]),
            (Metric.READY, "1 when warm and accepting requests", lambda: float(ready())),
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, read in self._gauges:
            yield GaugeMetricFamily(name, documentation, value=read())


def supervisor_registry(metrics_dir: Path, board: Board, ready: Callable[[], bool]) -> CollectorRegistry:
    """What ``/metrics`` serves: every process's counters merged, and the board's gauges."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    registry.register(BoardGauges(board, ready))
    return registry


def drain_seconds(board: Board) -> float:
    """The backlog over the measured rate (0 before any rate is known)."""
    rate = board[Cell.TOKENS_PER_SECOND]
    return board[Cell.BACKLOG_TOKENS] / rate if rate > 0 else 0.0
