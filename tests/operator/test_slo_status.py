"""The pure cores: SLO derivation and status conditions."""

from __future__ import annotations

from typing import Any

import pytest

from kembed_operator import slo, status
from kembed_operator.reconcile import contains
from kembed_operator.spec import parse_spec

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_slo_derivation() -> None:
    derived = slo.derive(parse_spec({"slo": {"p95LatencyMs": 800}}))
    assert derived == slo.Thresholds(
        max_drain_ms=800,
        p95_soft_ms=800,
        p95_hard_ms=1600,
        target_demand_ratio=0.7,
        target_queue_drain_s=0.32,
        target_latency_p95_s=0.8,
    )


def test_the_guards_cannot_propose_more_than_a_demand_that_reads_right() -> None:
    """The HPA takes the largest proposal, ceil(pods x value / target). Admission holds a pod's drain
    time at P / 2 and its served P95 near P, so the drain guard proposes at most 1.25 times the pods,
    what the demand proposes from 0.875 of capacity on, and the P95 guard nothing while P is met."""
    p_s = 0.8
    derived = slo.derive(parse_spec({"slo": {"p95LatencyMs": 800}}))
    assert (p_s / 2) / derived.target_queue_drain_s == pytest.approx(0.875 / derived.target_demand_ratio)
    assert p_s / derived.target_latency_p95_s == 1.0


def test_explicit_settings_win_one_by_one() -> None:
    spec = parse_spec({"admission": {"p95HardMs": 5000}, "autoscaling": {"targets": {"latencyP95Seconds": 2}}})
    derived = slo.derive(spec)
    assert (derived.p95_hard_ms, derived.target_latency_p95_s) == (5000, 2)
    assert (derived.p95_soft_ms, derived.max_drain_ms, derived.target_queue_drain_s) == (1000, 1000, 0.4)
    assert slo.derive(parse_spec({"autoscaling": {"targets": {"demandRatio": 0.85}}})).target_demand_ratio == 0.85


def deployment(generation: int = 1, **status_fields: int) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": 2}, "status": status_fields}


ROLLED_OUT = {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2}


# Every status's conditions, in the order the operator writes them.
CONDITION_TYPES = ("Ready", "Available", "Progressing", "Degraded", "MetricsAdmitted")
ADMITTED = status.Verdict(True, "PeersAdmitted", "")


def observed(
    dep: dict[str, Any] | None, problem: status.Problem | None = None, metrics: status.Verdict = ADMITTED
) -> status.Observed:
    return status.Observed(
        generation=3,
        deployment=dep,
        problem=problem,
        selector="s",
        endpoint="e",
        rest_endpoint="r",
        model="m",
        metrics=metrics,
    )


def conditions(result: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in result["conditions"]}


CASES = {
    "no deployment yet": (
        None,
        None,
        {"Ready": "False", "Available": "False", "Progressing": "True", "Degraded": "False"},
    ),
    "rolled out": (
        deployment(**ROLLED_OUT),
        None,
        {"Ready": "True", "Available": "True", "Progressing": "False", "Degraded": "False"},
    ),
    "new spec not observed": (
        deployment(2, **ROLLED_OUT),
        None,
        {"Ready": "False", "Available": "True", "Progressing": "True"},
    ),
    "surge pending": (
        deployment(**{**ROLLED_OUT, "updatedReplicas": 1}),
        None,
        {"Ready": "False", "Progressing": "True"},
    ),
    "old pods terminating": (deployment(**{**ROLLED_OUT, "replicas": 3}), None, {"Progressing": "True"}),
    "invalid spec keeps serving": (
        deployment(**ROLLED_OUT),
        status.Problem("InvalidSpec", "bad"),
        {"Ready": "False", "Available": "True", "Degraded": "True"},
    ),
}


@pytest.mark.parametrize(("dep", "problem", "expected"), CASES.values(), ids=CASES.keys())
def test_conditions(dep: dict[str, Any] | None, problem: status.Problem | None, expected: dict[str, str]) -> None:
    result = status.compute(observed(dep, problem), {}, T0)
    assert {k: v[0] for k, v in conditions(result).items() if k in expected} == expected
    assert result["observedGeneration"] == 3


def test_deployment_failures_degrade() -> None:
    failing = deployment(**ROLLED_OUT)
    failing["status"]["conditions"] = [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "slow"}
    ]
    assert conditions(status.compute(observed(failing), {}, T0))["Degraded"] == ("True", "ProgressDeadlineExceeded")
    quota = deployment(**ROLLED_OUT)
    quota["status"]["conditions"] = [{"type": "ReplicaFailure", "status": "True", "message": "exceeded quota"}]
    assert conditions(status.compute(observed(quota), {}, T0))["Degraded"] == ("True", "ReplicaFailure")


def test_transition_time_moves_only_on_flips() -> None:
    first = status.compute(observed(None), {}, T0)
    same = status.compute(observed(None), first, T1)
    assert all(c["lastTransitionTime"] == T0 for c in same["conditions"])
    assert not status.changed(same, first)
    flipped = status.compute(observed(deployment(**ROLLED_OUT)), first, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times == {"Ready": T1, "Available": T1, "Progressing": T1, "Degraded": T0, "MetricsAdmitted": T0}
    assert status.changed(flipped, first)


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        (ADMITTED, ("True", "PeersAdmitted")),
        (status.Verdict(False, "NoMetricsPeers", "no peer", alarming=True), ("False", "NoMetricsPeers")),
        (status.NOT_APPLIED, ("Unknown", "SpecNotApplied")),
    ],
    ids=["admitted", "blocked", "spec not applied"],
)
def test_metrics_admitted_leaves_ready_alone(metrics: status.Verdict, expected: tuple[str, str]) -> None:
    result = conditions(status.compute(observed(deployment(**ROLLED_OUT), metrics=metrics), {}, T0))
    assert result["MetricsAdmitted"] == expected
    assert result["Ready"] == ("True", "Serving")
    assert tuple(result) == CONDITION_TYPES


def test_drift_check_ignores_server_defaults_but_not_changes() -> None:
    wanted = {"spec": {"containers": [{"name": "s", "image": "a"}], "replicas": 1}}
    defaulted = {
        "spec": {
            "containers": [{"name": "s", "image": "a", "terminationMessagePath": "/x"}],
            "replicas": 1,
            "paused": False,
        }
    }
    assert contains(defaulted, wanted)
    assert not contains({"spec": {"containers": [{"name": "s", "image": "b"}], "replicas": 1}}, wanted)
    assert not contains({"spec": {"containers": [], "replicas": 1}}, wanted)
    assert not contains({"spec": {"containers": [{"name": "s", "image": "a"}]}}, wanted)
