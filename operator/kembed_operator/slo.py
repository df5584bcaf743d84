"""One latency objective, three consumers (pure).

``slo.p95LatencyMs`` (call it P) is what users want; the server's admission thresholds and the
autoscaler's targets follow from it unless set explicitly, so they cannot contradict each other:

* ``maxDrainMs = P``: a request whose longest wait (twice the backlog's drain time, with buckets)
  fits P can still meet the objective; one that may wait longer is rejected with retry pushback.
* ``p95SoftMs = P``: the server starts shedding a growing fraction once its P95 reaches the objective.
* ``p95HardMs = 2 P``: beyond twice the objective the server is drowning and rejects everything.

The autoscaler scales on the offered demand (``kembed_demand_ratio``: work offered, refusals
included, over a pod's capacity) to ``demandRatio = 0.7``: proportional to the load per pod and
summed over pods, so the HPA's ``ceil(pods x average / target)`` is ``ceil(offered / 0.7 pod)``, the
size the load needs with 30% headroom for a rise during a pod start. The drain time and the P95 are
guards, placed where they act only when a pod is at admission's edge, which a demand that reads
right has already sized for (docs/operator.md, "Autoscaling on the server's metrics"):

* HPA ``queueDrainSeconds = 0.4 P``: admission holds a pod's drain time at P / 2, so this guard
  proposes at most 1.25 times the pods, and only near capacity, where a demand at or over 0.875 has
  proposed more (0.875 / 0.7 = 1.25).
* HPA ``latencyP95Seconds = P``: admission keeps the served P95 under P while its estimates hold, so
  this guard proposes more pods only when the objective is missed (a service rate read high, which
  makes the demand read low too).
"""

from __future__ import annotations

from dataclasses import dataclass

from kembed_operator.spec import EmbeddingServiceSpec

DRAIN_FACTOR = 1.0
SOFT_FACTOR = 1.0
HARD_FACTOR = 2.0
SCALE_DEMAND_RATIO = 0.7
SCALE_DRAIN_FACTOR = 0.4
SCALE_LATENCY_FACTOR = 1.0


@dataclass(frozen=True)
class Thresholds:
    """Admission settings in milliseconds and autoscaling targets (per-pod averages): the demand a
    ratio, the guards in seconds."""

    max_drain_ms: float
    p95_soft_ms: float
    p95_hard_ms: float
    target_demand_ratio: float
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
        target_demand_ratio=_either(targets.demand_ratio, SCALE_DEMAND_RATIO),
        target_queue_drain_s=_either(targets.queue_drain_seconds, SCALE_DRAIN_FACTOR * p95_ms / 1000),
        target_latency_p95_s=_either(targets.latency_p95_seconds, SCALE_LATENCY_FACTOR * p95_ms / 1000),
    )


def _either(explicit: float | None, derived: float) -> float:
    return derived if explicit is None else explicit
