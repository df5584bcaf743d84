"""What a run writes beside its verdicts: the per-second timeline and its figures rounded."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.fleet import judge as fleet_judge
from bench.fleet.judge import Call, Segment
from bench.tools.report import percentile


def per_second(calls: Sequence[Call], end: float, capacity: float, segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """One-second bins: offered rate (the profile's), calls by outcome, P95 of the answered."""
    bins: list[list[Call]] = [[] for _ in range(math.ceil(end))]
    for call in calls:
        if 0 <= call.scheduled < end:
            bins[int(call.scheduled)].append(call)
    return [
        {
            "t": i,
            "offered_per_s": capacity * fleet_judge.level_at(segments, i + 0.5),
            "calls": len(b),
            "refused": sum(c.outcome == "refused" for c in b),
            "lost": sum(c.outcome == "lost" for c in b),
            "p95_ms": 1000 * percentile([c.latency for c in b if c.outcome == "ok"], 95),
        }
        for i, b in enumerate(bins)
    ]


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats to ``digits`` decimals, all through (a run's timeline is long; its clock is not that exact)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value
