"""One reconcile against an in-memory stand-in for the API: writes only on drift, errors become conditions."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from kembed_operator import handlers, kube, reconcile
from kembed_operator.config import OperatorConfig

Key = tuple[str, str, str]


class FakeApi:
    """kube's functions over a dict; records every write."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.fail: dict[str, ApiException] = {}
        for name in ("get", "create", "apply", "delete", "patch_status"):
            monkeypatch.setattr(kube, name, getattr(self, name))

    def _check(self, verb: str, res: kube.Resource) -> None:
        if verb in self.fail:
            raise self.fail[verb]
        self.writes.append((verb, res.plural))

    def get(self, res: kube.Resource, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((res.plural, namespace, name))

    def create(self, res: kube.Resource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check("create", res)
        self.objects[res.plural, namespace, body["metadata"]["name"]] = body
        return body

    def apply(self, res: kube.Resource, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check("apply", res)
        self.objects[res.plural, namespace, name] = body
        return body

    def delete(self, res: kube.Resource, namespace: str, name: str) -> None:
        self._check("delete", res)
        self.objects.pop((res.plural, namespace, name), None)

    def patch_status(self, res: kube.Resource, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self._check("patch_status", res)
        self.status = status
        return status


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    return FakeApi(monkeypatch)


def body(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"name": "emb", "namespace": "ns", "uid": "u1", "generation": 2}
    return {"metadata": meta, "spec": spec, "status": status or {}}


def conditions(api: FakeApi) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in api.status["conditions"]}


def test_second_reconcile_writes_nothing(api: FakeApi) -> None:
    outcome = reconcile.reconcile(body({"maxReplicas": 2}), OperatorConfig())
    assert sorted(outcome.changes) == sorted(
        [
            "created Deployment/emb",
            "created Service/emb",
            "created PodDisruptionBudget/emb",
            "created HorizontalPodAutoscaler/emb",
            "created NetworkPolicy/emb",
        ]
    )
    first_status, api.writes = api.status, []
    again = reconcile.reconcile(body({"maxReplicas": 2}, first_status), OperatorConfig())
    assert (again.changes, api.writes) == ([], [])  # converged: reads only, not even a status write


def test_invalid_spec_keeps_the_children_and_reports(api: FakeApi) -> None:
    reconcile.reconcile(body({}), OperatorConfig())
    api.writes = []
    outcome = reconcile.reconcile(body({"admission": {"p95SoftMs": 9000}}), OperatorConfig())
    assert outcome.problem is not None and outcome.problem_is_new
    assert api.writes == [("patch_status", "embeddingservices")]  # no child touched
    assert conditions(api)["Degraded"] == ("True", "InvalidSpec")
    assert api.status["observedGeneration"] == 2


def test_rejected_child_degrades(api: FakeApi) -> None:
    api.fail["create"] = ApiException(status=422, reason="Unprocessable Entity")
    outcome = reconcile.reconcile(body({}), OperatorConfig())
    assert outcome.problem is not None and outcome.problem.reason == "ApplyRejected"
    assert conditions(api)["Degraded"] == ("True", "ApplyRejected")


def test_foreign_object_with_our_name_is_not_touched(api: FakeApi) -> None:
    api.objects["services", "ns", "emb"] = {"metadata": {"name": "emb", "ownerReferences": []}}
    outcome = reconcile.reconcile(body({}), OperatorConfig())
    assert outcome.problem is not None and outcome.problem.reason == "NameConflict"
    assert ("apply", "services") not in api.writes


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_transient_errors_are_retried_with_backoff(api: FakeApi, status: int) -> None:
    api.fail["create"] = ApiException(status=status)
    with pytest.raises(kopf.TemporaryError) as raised:
        handlers._reconcile(kopf.Body(body({})), retry=3)  # type: ignore[arg-type]
    assert raised.value.delay == 8.0
    with pytest.raises(kopf.TemporaryError) as capped:
        handlers._reconcile(kopf.Body(body({})), retry=30)  # type: ignore[arg-type]
    assert capped.value.delay == handlers.MAX_BACKOFF_S
