"""One latency objective, three consumers (pure).

``slo.p95LatencyMs`` (call it P) is what users want; the server's admission thresholds and the
autoscaler's targets follow from it unless set explicitly, so they cannot contradict each other:

* ``maxDrainMs = P``: a request whose longest wait (twice the backlog's drain time, with buckets)
  fits P can still meet the objective; one that may wait longer is rejected with retry pushback.
* ``p95SoftMs = P``: the server starts shedding a growing fraction once its P95 reaches the objective.
* ``p95HardMs = 2 P``: beyond twice the objective the server is drowning and rejects everything.
* HPA ``queueDrainSeconds = P / 4`` and ``latencyP95Seconds = 0.8 P``: the autoscaler adds replicas
  while pods still have headroom, so admission is the backstop when scaling cannot keep up, not the
  normal path. The drain metric is the plain drain time, and admission refuses at P / 2 of it
  (the longest bucketed wait is twice the drain time), so scaling starts at half that.
"""

from __future__ import annotations

from dataclasses import dataclass

from kembed_operator.spec import EmbeddingServiceSpec

DRAIN_FACTOR = 1.0
SOFT_FACTOR = 1.0
HARD_FACTOR = 2.0
SCALE_DRAIN_FACTOR = 0.25
SCALE_LATENCY_FACTOR = 0.8


@dataclass(frozen=True)
class Thresholds:
    """Admission settings in milliseconds and autoscaling targets in seconds (per-pod averages)."""

    max_drain_ms: float
    p95_soft_ms: float
    p95_hard_ms: float
    target_queue_drain_s: float
    target_latency_p95_s: float


def derive(spec: EmbeddingServiceSpec) -> Thresholds:
    """Explicit settings win; everything unset follows from ``slo.p95LatencyMs``."""
    p95_ms = float(spec.slo.p95_latency_ms)
    admission, targets = spec.admission, spec.autoscaling.targets
    return Thresholds(
        max_drain_ms=_either(admission.max_drain_ms, DRAIN_FACTOR * p95_ms),
        p95_soft_ms=_either(admission.p95_soft_ms, SOFT_FACTOR * p95_ms),
        p95_hard_ms=_either(admission.p95_hard_ms, HARD_FACTOR * p95_ms),
        target_queue_drain_s=_either(targets.queue_drain_seconds, SCALE_DRAIN_FACTOR * p95_ms / 1000),
        target_latency_p95_s=_either(targets.latency_p95_seconds, SCALE_LATENCY_FACTOR * p95_ms / 1000),
    )


def _either(explicit: float | None, derived: float) -> float:
    return derived if explicit is None else explicit
