"""The children's state in, the EmbeddingService status out (pure; the clock is an argument).

Conditions follow the Kubernetes API conventions: ``Available`` (at least one replica serves),
``Progressing`` (a rollout or scale is under way), ``Degraded`` (something needs a human),
``Ready`` (all of the spec is in effect and serving) and ``MetricsAdmitted`` (the NetworkPolicy
lets something scrape the metrics port, which autoscaling needs; it leaves ``Ready`` alone, since
the operator cannot see a scraper that the CNI admits anyway). ``lastTransitionTime`` moves only
when a condition's status flips, so watchers can tell how long a state has held.
"""

from __future__ import annotations

from dataclasses import dataclass

from kembed_operator.kinds import Manifest


@dataclass(frozen=True)
class Problem:
    """Why the spec could not be put into effect (an invalid spec, a rejected child)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Verdict:
    """A condition decided from the spec alone; ``holds`` None: unknown (the spec is not in effect)."""

    holds: bool | None
    reason: str
    message: str
    alarming: bool = False  # worth a Warning event when the status first says so


NOT_APPLIED = Verdict(None, "SpecNotApplied", "the spec is not in effect: see the Degraded condition")


@dataclass(frozen=True)
class Observed:
    """What the operator knows after a reconcile."""

    generation: int
    deployment: Manifest | None  # the live Deployment, None when it could not be read or made
    problem: Problem | None
    selector: str
    endpoint: str
    rest_endpoint: str
    model: str
    metrics: Verdict  # whether anything may scrape the metrics port
    transport: str = "plaintext"  # what a client must speak to the endpoint: plaintext, tls or mtls


def compute(observed: Observed, previous: Manifest, now: str) -> Manifest:
    """The full status; ``previous`` is the current status (for transition times)."""
    dep_status = (observed.deployment or {}).get("status", {})
    replicas = int(dep_status.get("replicas", 0))
    ready = int(dep_status.get("readyReplicas", 0))
    available = int(dep_status.get("availableReplicas", 0))
    rolling = _rollout_pending(observed.deployment)
    failure = _deployment_failure(observed.deployment)
    problem = observed.problem or failure

    conditions = [
        _ready(problem, rolling, available),
        ("Available", available > 0, *_available_reason(available)),
        ("Progressing", rolling is not None, "RolloutInProgress" if rolling else "RolloutComplete", rolling or ""),
        ("Degraded", problem is not None, *((problem.reason, problem.message) if problem else ("AsExpected", ""))),
        ("MetricsAdmitted", observed.metrics.holds, observed.metrics.reason, observed.metrics.message),
    ]
    old = {c.get("type"): c for c in previous.get("conditions", [])}
    return {
        "observedGeneration": observed.generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": observed.selector,
        "endpoint": observed.endpoint,
        "restEndpoint": observed.rest_endpoint,
        "model": observed.model,
        "transport": observed.transport,
        "conditions": [condition(*c, old.get(c[0]), now) for c in conditions],
    }


def _ready(problem: Problem | None, rolling: str | None, available: int) -> tuple[str, bool, str, str]:
    if problem is not None:
        return "Ready", False, problem.reason, problem.message
    if rolling is not None:
        return "Ready", False, "RolloutInProgress", rolling
    if available == 0:
        return "Ready", False, "NoReplicasAvailable", "no replica has passed its readiness probe yet"
    return "Ready", True, "Serving", f"{available} replica(s) serving"


def _available_reason(available: int) -> tuple[str, str]:
    if available:
        return "MinimumReplicasAvailable", f"{available} replica(s) available"
    return "NoReplicasAvailable", "no replica is available"


def _rollout_pending(deployment: Manifest | None) -> str | None:
    """Why a rollout is still under way (the ``kubectl rollout status`` rules), or None when done."""
    if deployment is None:
        return "the Deployment does not exist yet"
    meta, spec, status = deployment.get("metadata", {}), deployment.get("spec", {}), deployment.get("status", {})
    wanted = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas", 0))
    if int(status.get("observedGeneration", 0)) < int(meta.get("generation", 0)):
        return "waiting for the Deployment controller to observe the new spec"
    if updated < wanted:
        return f"{updated} of {wanted} replicas updated"
    if int(status.get("replicas", 0)) > updated:
        return f"{int(status.get('replicas', 0)) - updated} old replica(s) terminating"
    if int(status.get("availableReplicas", 0)) < updated:
        return f"{status.get('availableReplicas', 0)} of {updated} updated replicas available"
    return None


def _deployment_failure(deployment: Manifest | None) -> Problem | None:
    """The Deployment controller's own verdicts that need a human: quota, deadline exceeded."""
    for cond in (deployment or {}).get("status", {}).get("conditions", []):
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Problem("ReplicaFailure", cond.get("message", ""))
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Problem("ProgressDeadlineExceeded", cond.get("message", ""))
    return None


def condition(kind: str, true: bool | None, reason: str, message: str, old: Manifest | None, now: str) -> Manifest:
    status = "Unknown" if true is None else "True" if true else "False"
    unchanged = old is not None and old.get("status") == status and old.get("lastTransitionTime")
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": old["lastTransitionTime"] if unchanged and old else now,
    }


def changed(new: Manifest, current: Manifest) -> bool:
    """Whether patching ``new`` over ``current`` would change anything (skips no-op writes)."""
    return any(current.get(key) != value for key, value in new.items())
