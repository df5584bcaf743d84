"""One EmbeddingJob reconcile against an in-memory client: it waits for its service, makes its Job
once, refuses what is not allowed, and follows the Job's and pods' states."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kembed_operator import job_render
from kembed_operator.config import OperatorConfig
from kembed_operator.job_reconcile import reconcile_job
from kembed_operator.reconcile import ReconcileResult
from tests.operator.test_job_render import BASE
from tests.operator.test_job_status import COMPLETE, pod
from tests.operator.test_reconcile import FakeClient

NS = "search"
READY = {"conditions": [{"type": "Ready", "status": "True", "reason": "Serving"}]}


@pytest.fixture
def api() -> FakeClient:
    return FakeClient()


def run(
    api: FakeClient,
    spec: dict[str, Any] | None = None,
    generation: int = 1,
    failures: int = 0,
    config: OperatorConfig | None = None,
) -> ReconcileResult:
    meta = {"name": "wiki", "namespace": NS, "uid": "ej-uid", "generation": generation}
    body = {"metadata": meta, "spec": BASE if spec is None else spec, "status": copy.deepcopy(api.status)}
    return reconcile_job(body, config or OperatorConfig(), api, failures)


def serve(api: FakeClient, status: dict[str, Any] | None = None, **spec: Any) -> None:
    """The EmbeddingService the job calls, as the API shows it."""
    body = {"metadata": {"name": "bge", "namespace": NS}, "spec": spec, "status": READY if status is None else status}
    api.objects["embeddingservices", NS, "bge"] = body


def progressing(api: FakeClient) -> tuple[str, str, str]:
    found = next(c for c in api.status["conditions"] if c["type"] == "Progressing")
    return found["status"], found["reason"], found["message"]


def the_job(api: FakeClient) -> dict[str, Any]:
    return api.objects["jobs", NS, "wiki"]


def test_it_waits_for_a_missing_service_then_one_not_ready(api: FakeClient) -> None:
    result = run(api)
    assert progressing(api)[:2] == ("False", "ServiceNotFound") and "'bge'" in progressing(api)[2]
    assert (result.changes, result.warnings) == ([], [])  # waiting is no fault: no Warning event
    serve(api, {"conditions": [{"type": "Ready", "status": "False", "message": "no replica has passed"}]})
    run(api)
    assert progressing(api)[:2] == ("False", "ServiceNotReady") and "no replica has passed" in progressing(api)[2]
    assert ("jobs", NS, "wiki") not in api.objects
    serve(api)
    assert run(api).changes == ["created Job/wiki"]
    assert progressing(api)[:2] == ("True", "ShardsRunning")
    (ref,) = the_job(api)["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"]) == ("EmbeddingJob", "ej-uid")


def test_a_converged_job_writes_nothing(api: FakeClient) -> None:
    serve(api)
    run(api)
    api.calls = []
    assert run(api).changes == []
    assert api.writes() == []
    # Reads: the Job (kopf's index in production) and its pods (one LIST by label).
    assert sorted(api.calls) == [("get", "jobs"), ("select", "pods")]


def test_the_status_follows_the_job_and_its_pods(api: FakeClient) -> None:
    serve(api)
    run(api)
    job = the_job(api)
    job["metadata"]["uid"] = "job-uid"  # what the API server stamps; the pods name it as their owner
    job["status"] = {"active": 0, "succeeded": 4, "failed": 1, "completedIndexes": "0-3", "conditions": [COMPLETE]}
    pods = [pod(0, "Succeeded", 5), pod(1, "Failed", 2), pod(1, "Succeeded", 6, finished="2026-01-01T00:09:00Z")]
    pods += [pod(2, "Succeeded", 7), pod(3, "Succeeded", 8)]
    for index, manifest in enumerate(pods):
        manifest["metadata"] |= {"name": f"wiki-{index}", "labels": job_render.labels("wiki")}
        api.objects["pods", NS, f"wiki-{index}"] = manifest
    api.objects["pods", NS, "stranger"] = {"metadata": {"labels": {"app": "x"}}, "status": {}}
    run(api)
    assert (api.status["rowsWritten"], api.status["shardsSucceeded"], api.status["podFailures"]) == (26, 4, 1)
    assert progressing(api)[:2] == ("False", "Complete")
    # Finished: the pods are no longer read, and a deleted Job is not made again.
    del api.objects["jobs", NS, "wiki"]
    api.calls = []
    assert run(api).changes == []
    assert ("select", "pods") not in api.calls and api.writes() == []
    assert api.status["rowsWritten"] == 26


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({**BASE, "image": "evil.example/miner:1"}, "ImageNotAllowed"),
        ({**BASE, "env": [{"name": "LD_PRELOAD", "value": "/data/corpora/x.so"}]}, "EnvNotAllowed"),
        (
            {**BASE, "podAnnotations": {"container.apparmor.security.beta.kubernetes.io/embed": "unconfined"}},
            "PodAnnotationNotAllowed",
        ),
    ],
    ids=["image", "env", "annotation"],
)
def test_what_is_not_allowed_is_not_run_and_reported_once(api: FakeClient, spec: dict[str, Any], reason: str) -> None:
    serve(api)
    result = run(api, spec)
    assert ("jobs", NS, "wiki") not in api.objects
    assert progressing(api)[:2] == ("False", reason)
    assert [w.reason for w in result.warnings] == [reason]
    assert run(api, spec).warnings == []  # a Warning event once


def test_the_services_image_is_checked_too(api: FakeClient) -> None:
    serve(api, image="registry.example/kembed-server:2")
    run(api)
    assert progressing(api)[:2] == ("False", "ImageNotAllowed")
    run(api, config=OperatorConfig(allowed_images=("registry.example/*",)))
    assert the_job(api)["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/kembed-server:2"


def test_an_mtls_service_without_a_client_certificate(api: FakeClient) -> None:
    serve(api, tls={"secretName": "bge-tls", "clientCASecretName": "clients"})
    result = run(api)
    assert progressing(api)[:2] == ("False", "InvalidSpec") and "spec.tls.clientSecretName" in progressing(api)[2]
    assert [w.reason for w in result.warnings] == ["InvalidSpec"]


def test_an_invalid_spec_is_reported(api: FakeClient) -> None:
    serve(api)
    run(api, {**BASE, "input": {"claimName": "c", "path": "/etc/passwd"}})
    assert progressing(api)[:2] == ("False", "InvalidSpec") and "spec.input.path" in progressing(api)[2]


def test_a_foreign_job_with_our_name_is_not_touched(api: FakeClient) -> None:
    serve(api)
    api.objects["jobs", NS, "wiki"] = {"metadata": {"name": "wiki", "ownerReferences": []}, "spec": {}}
    result = run(api)
    assert progressing(api)[:2] == ("False", "NameConflict")
    assert [w.reason for w in result.warnings] == ["NameConflict"]
    assert api.writes() == [("patch_status", "embeddingjobs")]


def test_a_spec_change_after_the_job_is_made_is_not_applied(api: FakeClient) -> None:
    serve(api)
    run(api)
    made = copy.deepcopy(the_job(api))
    result = run(api, {**BASE, "shards": 32}, generation=2)
    assert the_job(api) == made
    assert [w.reason for w in result.warnings] == ["SpecChangeIgnored"]
    assert api.status["observedGeneration"] == 1  # the status describes the Job made from generation 1
    assert "spec generation 2 is not applied" in progressing(api)[2]
    assert run(api, {**BASE, "shards": 32}, generation=2).warnings == []  # said once


@pytest.mark.parametrize("code", [409, 429, 500, 503])
def test_transient_errors_retry_and_show_from_the_second(api: FakeClient, code: int) -> None:
    serve(api)
    api.fail["create"] = ApiException(status=code, reason="Flaky")
    assert run(api).error is not None
    assert progressing(api)[1] == "JobPending"
    assert run(api, failures=1).error is not None
    assert progressing(api)[:2] == ("False", "ApiUnavailable")
    del api.fail["create"]
    assert run(api, failures=2).changes == ["created Job/wiki"]


def test_a_rejected_job_needs_a_human(api: FakeClient) -> None:
    serve(api)
    api.fail["create"] = ApiException(status=422, reason="Unprocessable Entity")
    result = run(api)
    assert result.error is None
    assert progressing(api)[:2] == ("False", "ApplyRejected")
