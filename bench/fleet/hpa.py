"""The HorizontalPodAutoscaler controller's algorithm, as kube-controller-manager runs it (pure).

Followed from the documented algorithm and the controller's source (pkg/controller/podautoscaler:
``replica_calculator.go`` calcPlainMetricReplicas and groupPods, ``horizontal.go``
stabilizeRecommendationWithBehaviors and convertDesiredReplicasWithBehaviorRate):

* per metric, desired = ceil(ready pods x average value / target), unchanged within the tolerance
  (10%); pods pending or without a value are left out, then counted at 0 (scale-up) or at the target
  (scale-down, missing values only), and a change the rebalanced ratio reverses is dropped;
* over several metrics, the largest proposal;
* stabilisation: the lowest proposal of the scale-up window and the highest of the scale-down
  window bound the change;
* rate: each direction's policies (Pods or Percent per period, counted from the replicas at the
  period's start) choose the limit (``Max``: the largest change, ``Min``: the smallest, or Disabled).

Times are seconds on any clock; the bench compresses them (``scaled``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

TOLERANCE = 0.1
SYNC_PERIOD_S = 15.0  # --horizontal-pod-autoscaler-sync-period
CPU_INITIALIZATION_PERIOD_S = 300.0  # --horizontal-pod-autoscaler-cpu-initialization-period
Select = Literal["Max", "Min", "Disabled"]


@dataclass(frozen=True)
class Policy:
    type: Literal["Pods", "Percent"]
    value: int
    period_s: float


@dataclass(frozen=True)
class Rules:
    """One direction of an HPA's ``behavior``."""

    stabilization_s: float
    policies: tuple[Policy, ...]
    select: Select = "Max"


@dataclass(frozen=True)
class Behavior:
    up: Rules
    down: Rules

    def scaled(self, compression: float) -> Behavior:
        """Every period and window divided by ``compression`` (a bench's compressed time)."""

        def rules(r: Rules) -> Rules:
            policies = tuple(replace(p, period_s=p.period_s / compression) for p in r.policies)
            return replace(r, stabilization_s=r.stabilization_s / compression, policies=policies)

        return Behavior(rules(self.up), rules(self.down))


# The defaults the API server fills in for an HPA whose behavior (or one direction of it) is unset.
DEFAULT_UP = Rules(0.0, (Policy("Percent", 100, 15.0), Policy("Pods", 4, 15.0)))
DEFAULT_DOWN = Rules(300.0, (Policy("Percent", 100, 15.0),))


def behavior(manifest: Mapping[str, Any] | None) -> Behavior:
    """An autoscaling/v2 ``behavior`` (as the operator renders it, or None) with the API's defaults."""
    manifest = manifest or {}
    return Behavior(_rules(manifest.get("scaleUp"), DEFAULT_UP), _rules(manifest.get("scaleDown"), DEFAULT_DOWN))


def _rules(manifest: Mapping[str, Any] | None, default: Rules) -> Rules:
    if manifest is None:
        return default
    policies = tuple(
        Policy(p["type"], int(p["value"]), float(p["periodSeconds"])) for p in manifest.get("policies", ())
    )
    return Rules(
        float(manifest.get("stabilizationWindowSeconds", default.stabilization_s)),
        policies or default.policies,
        manifest.get("selectPolicy", default.select),
    )


# --- one metric -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """What the controller knows of a pod at a sync."""

    name: str
    pending: bool = False  # not running yet (scheduled, pulling, starting)
    deleting: bool = False  # has a deletionTimestamp
    ready: bool = True
    started_at: float = 0.0
    ready_since: float | None = 0.0  # when the Ready condition last turned true


def desired_for_metric(
    pods: Sequence[Pod],
    values: Mapping[str, float],
    target: float,
    current: int,
    cpu_window_start: float | None = None,
    now: float = 0.0,
    cpu_initialization_s: float = CPU_INITIALIZATION_PERIOD_S,
    tolerance: float = TOLERANCE,
) -> int | None:
    """calcPlainMetricReplicas: the replicas one metric asks for (None: no pod has a value).

    ``values`` are per-pod values (a Pods metric) or per-pod utilisation (a CPU resource metric, with
    ``cpu_window_start`` set: the start of the usage samples' window, which decides CPU readiness)."""
    ready_count, unready, missing = _group(pods, values, cpu_window_start, now, cpu_initialization_s)
    kept = {p.name: values[p.name] for p in pods if p.name in values and not p.deleting and p.name not in unready}
    if not kept:
        return None
    ratio = sum(kept.values()) / len(kept) / target
    with_unready = bool(unready) and ratio > 1.0
    if not with_unready and not missing:
        return current if abs(1.0 - ratio) <= tolerance else math.ceil(ratio * ready_count)
    filled = dict(kept)
    for name in missing:  # missing: at the target on a scale-down, at 0 on a scale-up
        filled[name] = target if ratio < 1.0 else 0.0
    if with_unready:
        filled.update(dict.fromkeys(unready, 0.0))
    new_ratio = sum(filled.values()) / len(filled) / target
    reversed_ = (ratio < 1.0 < new_ratio) or (ratio > 1.0 > new_ratio)
    if abs(1.0 - new_ratio) <= tolerance or reversed_:
        return current
    proposal = math.ceil(new_ratio * len(filled))
    if (new_ratio < 1.0 and proposal > current) or (new_ratio > 1.0 and proposal < current):
        return current
    return proposal


def desired_for_total(total: float | None, target: float, current: int, tolerance: float = TOLERANCE) -> int | None:
    """GetExternalPerPodMetricReplicas: an External metric's total against an AverageValue target (a
    KEDA trigger's threshold), ceil(total / target), unchanged within the tolerance (None: no value)."""
    if total is None:
        return None
    if current > 0 and abs(1.0 - total / (target * current)) <= tolerance:
        return current
    return math.ceil(total / target)


def _group(
    pods: Sequence[Pod],
    values: Mapping[str, float],
    cpu_window_start: float | None,
    now: float,
    cpu_initialization_s: float,
) -> tuple[int, set[str], set[str]]:
    """groupPods: (ready count, unready, missing); deleted pods are in none of them."""
    ready_count, unready, missing = 0, set(), set()
    for pod in pods:
        if pod.deleting:
            continue
        if pod.pending:
            unready.add(pod.name)
        elif pod.name not in values:
            missing.add(pod.name)
        elif cpu_window_start is not None and _cpu_unready(pod, cpu_window_start, now, cpu_initialization_s):
            unready.add(pod.name)
        else:
            ready_count += 1
    return ready_count, unready, missing


def _cpu_unready(pod: Pod, window_start: float, now: float, initialization_s: float) -> bool:
    """CPU samples of a pod still starting mislead: within the initialization period a pod counts
    unready while not ready or while its sample began before it became ready; after it, only a pod
    that has never been ready does."""
    if pod.ready_since is None:
        return True
    if now - pod.started_at < initialization_s:
        return not pod.ready or window_start < pod.ready_since
    return False


# --- the controller -------------------------------------------------------------------------------


@dataclass
class Controller:
    """One HPA: recommendations and scale events remembered across syncs."""

    behavior: Behavior
    min_replicas: int
    max_replicas: int
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    up_events: list[tuple[float, int]] = field(default_factory=list)
    down_events: list[tuple[float, int]] = field(default_factory=list)

    def decide(self, now: float, current: int, proposals: Sequence[int | None]) -> int:
        """The replica count for this sync, given each metric's proposal (None: no value)."""
        known = [p for p in proposals if p is not None]
        if not known:  # every metric failed: the controller leaves the scale alone
            return current
        stabilized = self._stabilize(now, current, max(known))
        decided = self._rate_limited(now, current, stabilized)
        if decided > current:
            self.up_events.append((now, decided - current))
        elif decided < current:
            self.down_events.append((now, current - decided))
        return decided

    def _stabilize(self, now: float, current: int, desired: int) -> int:
        up_cutoff = now - self.behavior.up.stabilization_s
        down_cutoff = now - self.behavior.down.stabilization_s
        up, down = desired, desired
        for at, recommendation in self.recommendations:
            if at > up_cutoff:
                up = min(up, recommendation)
            if at > down_cutoff:
                down = max(down, recommendation)
        oldest = min(up_cutoff, down_cutoff)
        self.recommendations = [(at, r) for at, r in self.recommendations if at >= oldest] + [(now, desired)]
        return min(max(current, up), down)

    def _rate_limited(self, now: float, current: int, desired: int) -> int:
        if desired > current:
            limit = max(current, self._limit(now, current, self.behavior.up, up=True))
            return min(desired, self.max_replicas, limit)
        if desired < current:
            limit = min(current, self._limit(now, current, self.behavior.down, up=False))
            return max(desired, self.min_replicas, limit)
        return desired

    def _limit(self, now: float, current: int, rules: Rules, up: bool) -> int:
        """calculateScaleUpLimitWithScalingRules / calculateScaleDownLimitWithBehaviors."""
        if rules.select == "Disabled":
            return current
        proposals = []
        for policy in rules.policies:
            added = _changed_since(self.up_events, now - policy.period_s)
            removed = _changed_since(self.down_events, now - policy.period_s)
            start = current - added + removed
            if policy.type == "Pods":
                proposals.append(start + policy.value if up else start - policy.value)
            elif up:
                proposals.append(math.ceil(start * (1 + policy.value / 100)))
            else:
                proposals.append(int(start * (1 - policy.value / 100)))
        largest_change = (rules.select == "Max") == up
        return max(proposals) if largest_change else min(proposals)


def _changed_since(events: Sequence[tuple[float, int]], cutoff: float) -> int:
    return sum(change for at, change in events if at > cutoff)
