"""One reconcile of an EmbeddingJob: wait for its service, make its Job once, write the status. Idempotent.

The Job is made once and never changed: its pod template is immutable, so a spec changed after
the Job exists is not applied (a Warning event says so, and ``observedGeneration`` stays at the
generation the Job was made from). A finished job is never run again, even when its Job is deleted
(by hand, or a TTL): the status keeps what it last said. The pods are read (their owner's instance
label selects them) only until the status says the job has finished.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from kembed_operator import job_render, job_status, kinds, kube, render, trust
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import EmbeddingJobSpec, parse_job_spec
from kembed_operator.kinds import Manifest
from kembed_operator.reconcile import Client, ReconcileResult, describe, owned
from kembed_operator.spec import InvalidSpec, parse_spec
from kembed_operator.status import Problem, changed

# Reasons to wait that are no fault: the status says them, no Warning event does.
WAITING = frozenset({"ServiceNotFound", "ServiceNotReady"})


def reconcile_job(
    body: Mapping[str, Any], config: OperatorConfig, client: Client, failures: int = 0
) -> ReconcileResult:
    """``failures``: how many attempts in a row failed before this one (the status says so from the second)."""
    meta = body["metadata"]
    owner = render.Owner(meta["name"], meta["namespace"], meta["uid"], kinds.EMBEDDING_JOB)
    generation = int(meta.get("generation", 0))
    previous = dict(body.get("status") or {})
    result = ReconcileResult()
    try:
        spec: EmbeddingJobSpec | None = parse_job_spec(dict(body.get("spec") or {}))
    except InvalidSpec as err:
        spec, result.problem = None, Problem(err.reason, str(err))
    job = client.get(kinds.JOB, owner.namespace, owner.name)
    if job is not None and not owned(job, owner):
        job = None
        result.problem = Problem("NameConflict", f"Job {owner.name} exists and is not owned by this EmbeddingJob")
    elif job is None and spec is not None and not job_status.finished(previous):
        job = _make(client, owner, generation, spec, config, result)
    if result.error is not None and failures > 0 and result.problem is None:
        result.problem = Problem("ApiUnavailable", f"{describe(result.error)}; retrying")
    made_from = generation if job is None else _made_from(job)
    notice = ""
    if made_from < generation:
        notice = (
            f"spec generation {generation} is not applied: the Job was made from generation {made_from} and cannot "
            "change; delete this EmbeddingJob and create it again (finished parts are kept)"
        )
    pods = None
    if job is not None and not job_status.finished(previous):
        pods = client.select(kinds.POD, owner.namespace, job_render.labels(owner.name))
    observed = job_status.JobObserved(
        generation=made_from,
        shards=spec.shards if spec is not None else int(previous.get("shards", 0)),
        manifest=spec.manifest_path if spec is not None else str(previous.get("manifest", "")),
        job=job,
        pods=pods,
        problem=result.problem,
        notice=notice,
    )
    new = job_status.compute(observed, previous, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    if result.problem is not None and result.problem.reason not in WAITING and _is_new(result.problem, previous):
        result.warnings.append(result.problem)
    if notice and notice not in _progressing(previous).get("message", ""):
        result.warnings.append(Problem("SpecChangeIgnored", notice))
    if changed(new, previous):
        client.patch_status(kinds.EMBEDDING_JOB, owner.namespace, owner.name, new)
    return result


def _make(
    client: Client,
    owner: render.Owner,
    generation: int,
    spec: EmbeddingJobSpec,
    config: OperatorConfig,
    result: ReconcileResult,
) -> Manifest | None:
    """The Job, made once its service is ready; None, with ``result`` saying why, when it is not made."""
    service = client.get(kinds.EMBEDDING_SERVICE, owner.namespace, spec.service)
    if service is None:
        message = f"spec.service: no EmbeddingService {spec.service!r} in this namespace; the job waits for one"
        result.problem = Problem("ServiceNotFound", message)
        return None
    ready: Manifest = next((c for c in service.get("status", {}).get("conditions", []) if c.get("type") == "Ready"), {})
    if ready.get("status") != "True":
        why = ready.get("message") or ready.get("reason") or "no status yet"
        result.problem = Problem(
            "ServiceNotReady", f"EmbeddingService {spec.service!r} is not Ready ({why}); the job waits"
        )
        return None
    try:
        target = job_render.Target(spec.service, owner.namespace, parse_spec(dict(service.get("spec") or {})))
        trust.check_job(spec, job_render.image(spec, target, config), config)
        desired = job_render.render_job(owner, generation, spec, target, config)
    except InvalidSpec as err:
        result.problem = Problem(err.reason, str(err))
        return None
    try:
        job = client.create(kinds.JOB, owner.namespace, desired.manifest)
    except ApiException as err:
        if kube.is_transient(err):
            result.error = err
        else:  # quota, an admission webhook, a cluster without the Job fields used: a human must act
            result.problem = Problem("ApplyRejected", describe(err))
        return None
    result.changes.append(f"created Job/{owner.name}")
    return job


def _made_from(job: Manifest) -> int:
    annotations = job.get("metadata", {}).get("annotations", {})
    return int(annotations.get(job_render.GENERATION_ANNOTATION, 0))


def _progressing(status: Manifest) -> Manifest:
    return next((c for c in status.get("conditions", []) if c.get("type") == "Progressing"), {})


def _is_new(problem: Problem, previous: Manifest) -> bool:
    old = _progressing(previous)
    return (old.get("reason"), old.get("message")) != (problem.reason, problem.message)
