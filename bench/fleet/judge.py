"""The fleet bench's load profile and its targets, judged from what a run recorded (pure).

Load levels are multiples of one replica's measured capacity, so the size a level needs is
``ceil(level)``. A step up is a rise (ramp or spike) followed by a hold; its scale-up window runs
from the rise's start to the hold's start plus two sync periods and one pod start, the time the
targets give the fleet to grow.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.tools.report import percentile

REPLICA_SECONDS_LIMIT = 1.2  # replica-seconds at most this times the ideal


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    level_from: float
    level_to: float
    kind: str  # "hold", "ramp" or "spike"

    def level(self, t: float) -> float:
        if self.end == self.start:
            return self.level_to
        return self.level_from + (self.level_to - self.level_from) * (t - self.start) / (self.end - self.start)


# (seconds at full length, level reached, kind): 0.5x -> 1.4x -> 2.6x, a spike to 3.5x, and back.
SHAPE: tuple[tuple[float, float, str], ...] = (
    (25, 0.5, "hold"),
    (8, 1.4, "ramp"),
    (60, 1.4, "hold"),
    (8, 2.6, "ramp"),
    (60, 2.6, "hold"),
    (6, 3.5, "spike"),
    (25, 2.6, "hold"),
    (8, 1.4, "ramp"),
    (75, 1.4, "hold"),
    (8, 0.5, "ramp"),
    (75, 0.5, "hold"),
)


def profile(scale: float = 1.0, shape: Sequence[tuple[float, float, str]] = SHAPE) -> list[Segment]:
    """The shape's segments, every duration times ``scale``; a spike jumps and holds its level."""
    segments, t, level = [], 0.0, shape[0][1]
    for seconds, to, kind in shape:
        start_level = to if kind == "spike" else level
        segments.append(Segment(t, t + seconds * scale, start_level, to, kind))
        t, level = t + seconds * scale, to
    return segments


def level_at(segments: Sequence[Segment], t: float) -> float:
    for segment in segments:
        if segment.start <= t < segment.end:
            return segment.level(t)
    return segments[-1].level_to


def ideal_replicas(level: float) -> int:
    return max(1, math.ceil(level - 1e-9))


def scale_up_windows(segments: Sequence[Segment], sync_s: float, pod_start_s: float) -> list[tuple[float, float]]:
    """For each rise, (its start, the next hold's start + 2 sync periods + one pod start)."""
    windows = []
    for i, segment in enumerate(segments):
        if segment.level_to > segment.level_from or segment.kind == "spike":
            after = next((s for s in segments[i + 1 :] if s.kind == "hold"), segments[-1])
            grace = 2 * sync_s + pod_start_s
            end = segment.end + grace if segment.kind == "spike" else after.start + grace
            windows.append((segment.start, end))
    return windows


def inside(windows: Sequence[tuple[float, float]], t: float) -> bool:
    return any(start <= t < end for start, end in windows)


# --- targets --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """The fleet at one instant: its size as the scale asks (``replicas``), pods running (started,
    not yet exited: what is billed) and pods serving (ready, in the endpoints)."""

    t: float
    replicas: int
    running: int
    ready: int


@dataclass(frozen=True)
class Call:
    scheduled: float
    latency: float
    outcome: str  # "ok", "refused" or "lost"


def judge_steps(
    segments: Sequence[Segment], samples: Sequence[Sample], sync_s: float, pod_start_s: float
) -> list[dict[str, Any]]:
    """Per hold: its ideal size; for a hold after a rise, when the serving pods reached it (within
    the deadline?) and whether the size stayed within one replica after; for every hold, the
    changes of direction of the size (at most one) and the largest size once settled, against the
    size it needed (:func:`_needed`)."""
    verdicts = []
    grace = 2 * sync_s + pod_start_s
    for i, hold in enumerate(segments):
        if hold.kind != "hold":
            continue
        ideal = ideal_replicas(hold.level_to)
        during = [s for s in samples if hold.start <= s.t < hold.end]
        rose = i > 0 and segments[i - 1].level_to > segments[i - 1].level_from
        verdict: dict[str, Any] = {
            "start": hold.start,
            "level": hold.level_to,
            "ideal": ideal,
            "direction_changes": direction_changes([s.replicas for s in during]),
            "needed": ideal if rose else _needed(ideal, samples, hold.start + grace),
            "largest": max((s.replicas for s in samples if hold.start + grace <= s.t < hold.end), default=None),
        }
        verdict["no_flapping"] = verdict["direction_changes"] <= 1
        if rose:
            verdict.update(_step_up(segments[i - 1].start, hold, ideal, samples, grace))
        verdicts.append(verdict)
    return verdicts


def _needed(ideal: int, samples: Sequence[Sample], settled: float) -> int:
    """What a hold after a fall or at the start needs: its ideal size, or the size the fleet had
    once settled if larger (scaling down waits by design); growing past that is what it did not need."""
    before = [s.replicas for s in samples if s.t <= settled]
    return max(ideal, before[-1] if before else ideal)


def _step_up(rise_start: float, hold: Segment, ideal: int, samples: Sequence[Sample], grace: float) -> dict[str, Any]:
    deadline = hold.start + grace
    reached = next((s.t for s in samples if s.t >= rise_start and s.ready >= ideal), None)
    after = [s.replicas for s in samples if deadline <= s.t < hold.end]
    return {
        "deadline": deadline,
        "reached_at": reached,
        "reached_in_time": reached is not None and reached <= deadline,
        "held_within_one": all(abs(r - ideal) <= 1 for r in after) if after else None,  # None: hold too short
    }


def direction_changes(sizes: Sequence[int]) -> int:
    """How often a series of sizes turns from growing to shrinking or back."""
    moves = [b - a for a, b in itertools.pairwise(sizes) if b != a]
    return sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))


def replica_seconds(samples: Sequence[Sample], count: str = "running") -> float:
    """The integral of a count over the samples (each held until the next)."""
    return sum(getattr(a, count) * (b.t - a.t) for a, b in itertools.pairwise(samples))


def ideal_replica_seconds(segments: Sequence[Segment], step_s: float = 0.1) -> float:
    end = segments[-1].end
    return sum(ideal_replicas(level_at(segments, i * step_s)) * step_s for i in range(round(end / step_s)))


def slo_seconds(calls: Sequence[Call], slo_s: float, end: float) -> int:
    """One-second bins of the run in which the answered calls' P95 met the objective and no call
    was refused or lost (a bin without calls counts as met)."""
    bins: list[list[Call]] = [[] for _ in range(math.ceil(end))]
    for call in calls:
        if 0 <= call.scheduled < end:
            bins[int(call.scheduled)].append(call)
    return sum(1 for b in bins if _bin_met(b, slo_s))


def _bin_met(calls: Sequence[Call], slo_s: float) -> bool:
    if any(c.outcome != "ok" for c in calls):
        return False
    return not calls or percentile([c.latency for c in calls], 95) <= slo_s


def judge_calls(calls: Sequence[Call], windows: Sequence[tuple[float, float]], slo_s: float) -> dict[str, Any]:
    """P95 of the answered calls outside the scale-up windows, refusals outside them, and calls lost."""
    outside = [c for c in calls if not inside(windows, c.scheduled)]
    answered = [c.latency for c in outside if c.outcome == "ok"]
    p95 = percentile(answered, 95)
    refused_outside = sum(1 for c in outside if c.outcome == "refused")
    lost = sum(1 for c in calls if c.outcome == "lost")
    return {
        "calls": len(calls),
        "answered": sum(1 for c in calls if c.outcome == "ok"),
        "refused": sum(1 for c in calls if c.outcome == "refused"),
        "lost": lost,
        "p95_outside_windows_ms": p95 * 1000,
        "p95_met": not math.isnan(p95) and p95 <= slo_s,
        "refused_outside_windows": refused_outside,
        "refusals_only_in_windows": refused_outside == 0,
        "nothing_lost": lost == 0,
    }


def judge(
    segments: Sequence[Segment],
    samples: Sequence[Sample],
    calls: Sequence[Call],
    slo_s: float,
    sync_s: float,
    pod_start_s: float,
) -> dict[str, Any]:
    """Every target for one policy's run."""
    windows = scale_up_windows(segments, sync_s, pod_start_s)
    used, ideal = replica_seconds(samples), ideal_replica_seconds(segments)
    met = slo_seconds(calls, slo_s, segments[-1].end)
    steps = judge_steps(segments, samples, sync_s, pod_start_s)
    return {
        "windows": windows,
        "steps": steps,
        "steps_reached_in_time": all(s.get("reached_in_time") is not False for s in steps),
        "steps_held_within_one": all(s.get("held_within_one") is not False for s in steps),
        "no_flapping": all(s["no_flapping"] for s in steps),
        # The largest size a hold had once settled, over the size it needed (a retry storm's target:
        # its retries must not size the fleet past 1.3x what the first attempts need).
        "largest_over_needed": max((s["largest"] / s["needed"] for s in steps if s["largest"]), default=None),
        **judge_calls(calls, windows, slo_s),
        "replica_seconds": used,
        "ideal_replica_seconds": ideal,
        "replica_seconds_ratio": used / ideal,
        "replica_seconds_met": used <= REPLICA_SECONDS_LIMIT * ideal,
        "slo_seconds": met,
        "slo_seconds_per_replica_second": met / used if used else math.nan,
    }


def traffic_after_ready(pods: Sequence[tuple[float, float | None, float]], sync_s: float) -> dict[str, Any]:
    """Per pod that turned ready during the run and served at least one sync period, given as (ready
    at, first connection at or None, serving until): seconds from ready to its first connection,
    and whether each got one within one sync period."""
    delays = [None if first is None else first - ready for ready, first, until in pods if until - ready >= sync_s]
    return {
        "ready_to_first_connection_s": delays,
        "traffic_within_one_sync": all(d is not None and d <= sync_s for d in delays),
    }
