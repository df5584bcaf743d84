"""Prometheus metrics, named from ``kembed.contract`` (the operator's autoscaling reads them).

Every process of the server counts what it sees in prometheus-client's multiprocess mode (the
supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a folder of its own before starting them): front
ends count requests, their latency and their pre-screen rejections; the engine counts its own
rejections and its batches, and says which dtype and which forward it serves with, and why. The supervisor serves
``/metrics``: those files, merged, plus gauges of the present (offered demand, drain time, P95,
backlog, rate, by class where it differs) read off the engine's board at scrape time, so they are
never stale; the demand sums every front end's cells (:mod:`kembed.policy.demand`).

The autoscaling signals keep their names and say which class they count: the drain time is the
whole backlog's (every class), the P95 the interactive requests'. Per class, under the
``priority`` label: requests waiting, tokens waiting, the P95, rejections and request durations.
For an inference gateway's endpoint picker: waiting and running requests, and the saturation, a
0-1 share of the admission budget (``docs/gateway.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kembed.contract import PRIORITY_LABEL, Metric
from kembed.ipc.board import Board, Cell, ClassCell, FrontendCell
from kembed.policy import demand
from kembed.policy.priority import Priority

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_SIZE_BUCKETS = tuple(float(1 << i) for i in range(13))
BATCH_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(4, 20))


def _rejected(registry: CollectorRegistry) -> Counter:
    return Counter(
        Metric.REJECTED, "Requests rejected by admission control", ["reason", PRIORITY_LABEL], registry=registry
    )


class FrontendMetrics:
    def __init__(self) -> None:
        r = CollectorRegistry()
        self.request_duration = Histogram(
            Metric.REQUEST_DURATION_SECONDS,
            "Server-side latency of answered requests",
            [PRIORITY_LABEL],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        # A labelled child is looked up under a lock: once per class here, not once per request.
        self.request_durations = {p: self.request_duration.labels(priority=p.label) for p in Priority}
        stage = Histogram(
            Metric.REQUEST_STAGE_SECONDS,
            "Where answered requests spent their time: tokenizing, queued, computing (the total is the duration)",
            ["stage"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self._stages = tuple(stage.labels(stage=name) for name in ("tokenize", "queue", "compute"))
        self.requests = Counter(
            Metric.REQUESTS,
            "Answers by API (grpc, rest) and its status code (gRPC's name, HTTP's number)",
            ["api", "code"],
            registry=r,
        )
        self._answers: dict[tuple[str, str], Counter] = {}  # each (api, code)'s child, made at its first answer
        self.rejected = _rejected(r)
        self.refusals_paced = Counter(
            Metric.REFUSALS_PACED,
            "Refusals answered late: their client was refused faster than its refusal rate",
            registry=r,
        )
        self.refusals_shared = Counter(
            Metric.REFUSALS_SHARED,
            "Refusals charged to the bucket clients share once the table of clients is full",
            registry=r,
        )
        self.demoted = Counter(
            Metric.DEMOTED,
            "Interactive requests served as batch work: too large for their share of the interactive budget",
            registry=r,
        )
        self.stream_answers_dropped = Counter(
            Metric.STREAM_ANSWERS_DROPPED,
            "EmbedStream answers computed but never written: the drain ended before the client read them",
            registry=r,
        )
        self.calls_gone = Counter(
            Metric.CALLS_GONE,
            "Calls that ended before they could be answered: their deadline passed or their client left",
            ["api"],
            registry=r,
        )

    def answered(self, api: str, code: str) -> None:
        """Count an answer; its labelled child looked up once, not per call (under a lock)."""
        child = self._answers.get((api, code))
        if child is None:
            child = self._answers[api, code] = self.requests.labels(api=api, code=code)
        child.inc()

    def stages(self, tokenize_s: float, queue_s: float, compute_s: float) -> None:
        """An answered request's time in each stage."""
        for child, seconds in zip(self._stages, (tokenize_s, queue_s, compute_s), strict=True):
            child.observe(seconds)


def _choice(registry: CollectorRegistry, name: str, label: str, what: str) -> Gauge:
    """A start-up choice: 1 for what was chosen, labelled with it and the reason."""
    return Gauge(
        name,
        f"1 for {what}, with the reason it was chosen",
        [label, "reason"],
        registry=registry,
        multiprocess_mode="max",
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
        self.serving_dtype = _choice(r, Metric.SERVING_DTYPE, "dtype", "the dtype the model serves in")
        self.serving_forward = _choice(
            r, Metric.SERVING_FORWARD, "forward", "the forward that serves (eager, compiled on a CPU, or graphs)"
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

    def __init__(self, board: Board, ready: Callable[[], bool], demand_window_s: float) -> None:
        self._board = board
        self._gauges: list[tuple[str, str, Callable[[], float]]] = [
            (
                Metric.DEMAND_RATIO,
                "Work offered per second, refused included, over the work per second the pod can do "
                f"(padded tokens, weighted over {demand_window_s:g} s); 1 is at capacity",
                lambda: demand_ratio(board, time.monotonic(), demand_window_s),
            ),
            (
                Metric.QUEUE_DRAIN_SECONDS,
                "Estimated time to drain the backlog of every class",
                lambda: drain_seconds(board),
            ),
            (
                Metric.LATENCY_P95_SECONDS,
                "P95 server-side latency of interactive requests, sliding window",
                lambda: board.of_class(Priority.INTERACTIVE, ClassCell.P95_SECONDS),
            ),
            (
                Metric.QUEUED_TOKENS,
                "Padded tokens queued or in flight, every class",
                lambda: board[Cell.BACKLOG_TOKENS],
            ),
            (
                Metric.SERVICE_RATE,
                "Measured padded tokens per compute second",
                lambda: board[Cell.TOKENS_PER_SECOND],
            ),
            (
                Metric.CAPACITY,
                "Padded tokens per second the pod can serve: the best service rate, held (the demand's denominator)",
                lambda: board[Cell.CAPACITY],
            ),
            (Metric.WORKER_QUEUE_DEPTH, "Batches handed to the worker", lambda: board[Cell.IN_FLIGHT_BATCHES]),
            (Metric.RUNNING_REQUESTS, "Requests some of whose items started, not yet answered", lambda: running(board)),
            (
                Metric.SATURATION,
                "Share of the admission budget the backlog fills (drain time or queue cap), 0 to 1",
                lambda: board[Cell.SATURATION],
            ),
            (Metric.READY, "1 when warm and accepting requests", lambda: float(ready())),
        ]
        self._by_class = [
            (Metric.WAITING_REQUESTS, "Requests admitted, none of their items started", ClassCell.WAITING_REQUESTS),
            (Metric.WAITING_TOKENS, "Padded tokens queued, not yet in a batch", ClassCell.QUEUED_TOKENS),
            (Metric.PRIORITY_LATENCY_P95_SECONDS, "P95 server-side latency, sliding window", ClassCell.P95_SECONDS),
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, read in self._gauges:
            yield GaugeMetricFamily(name, documentation, value=read())
        for name, documentation, cell in self._by_class:
            family = GaugeMetricFamily(name, documentation, labels=[PRIORITY_LABEL])
            for priority in Priority:  # interactive first: a picker that names no label reads it
                family.add_metric([priority.label], self._board.of_class(priority, cell))
            yield family


def supervisor_registry(
    metrics_dir: Path, board: Board, ready: Callable[[], bool], demand_window_s: float
) -> CollectorRegistry:
    """What ``/metrics`` serves: every process's counters merged, and the board's gauges."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    registry.register(BoardGauges(board, ready, demand_window_s))
    return registry


def running(board: Board) -> float:
    """Requests admitted and not answered, less those none of whose items started."""
    waiting = sum(board.of_class(priority, ClassCell.WAITING_REQUESTS) for priority in Priority)
    return max(0.0, board[Cell.OPEN_REQUESTS] - waiting)


def demand_ratio(board: Board, now: float, window_s: float) -> float:
    """The work the pod's front ends were offered, as it stands at ``now``, over its capacity."""
    rates = (
        (board.frontend(i, FrontendCell.OFFERED_RATE), board.frontend(i, FrontendCell.OFFERED_AT))
        for i in range(board.frontends)
    )
    return demand.ratio(rates, now, board[Cell.CAPACITY], window_s)


def drain_seconds(board: Board) -> float:
    """The backlog over the measured rate, less what will expire before it could be computed (0
    before any rate is known)."""
    rate = board[Cell.TOKENS_PER_SECOND]
    lapsing = sum(board.of_class(priority, ClassCell.LAPSING_TOKENS) for priority in Priority)
    return (board[Cell.BACKLOG_TOKENS] - lapsing) / rate if rate > 0 else 0.0


def interactive_drain_seconds(board: Board) -> float:
    """What a query waits behind, over the measured rate: interactive work queued (less what will
    expire first) and in the worker."""
    rate, interactive = board[Cell.TOKENS_PER_SECOND], Priority.INTERACTIVE
    queued = board.of_class(interactive, ClassCell.QUEUED_TOKENS) - board.of_class(
        interactive, ClassCell.LAPSING_TOKENS
    )
    return (queued + board[Cell.IN_FLIGHT_INTERACTIVE_TOKENS]) / rate if rate > 0 else 0.0
