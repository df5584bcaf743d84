"""One reconcile against an in-memory client: writes only on drift, errors become conditions or retries."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kembed_operator import handlers, kinds, kube, reconcile
from kembed_operator.config import OperatorConfig
from kembed_operator.kinds import Kind

Key = tuple[str, str, str]


class FakeClient:
    """The reconcile's client over a dict; records every call."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, ApiException] = {}
        self.status: dict[str, Any] = {}

    def _record(self, verb: str, kind: Kind) -> None:
        self.calls.append((verb, kind.plural))
        if verb in self.fail:
            raise self.fail[verb]

    def writes(self) -> list[tuple[str, str]]:
        return [call for call in self.calls if call[0] not in ("get", "select")]

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        self._record("get", kind)
        return self.objects.get((kind.plural, namespace, name))

    def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self._record("create", kind)
        self.objects[kind.plural, namespace, body["metadata"]["name"]] = copy.deepcopy(body)
        return body

    def apply(self, kind: Kind, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self._record("apply", kind)
        self.objects[kind.plural, namespace, name] = copy.deepcopy(body)
        return body

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        self._record("delete", kind)
        self.objects.pop((kind.plural, namespace, name), None)

    def patch_status(self, kind: Kind, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self._record("patch_status", kind)
        self.status = status
        return status

    def select(self, kind: Kind, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        self._record("select", kind)
        return [
            copy.deepcopy(body)
            for (plural, ns, _), body in self.objects.items()
            if (plural, ns) == (kind.plural, namespace)
            and labels.items() <= body.get("metadata", {}).get("labels", {}).items()
        ]


@pytest.fixture
def api() -> FakeClient:
    return FakeClient()


def body(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"name": "emb", "namespace": "ns", "uid": "u1", "generation": 2}
    return {"metadata": meta, "spec": spec, "status": status or {}}


def run(
    api: FakeClient, spec: dict[str, Any], failures: int = 0, config: OperatorConfig | None = None
) -> reconcile.ReconcileResult:
    """A reconcile of ``spec`` over the status the previous one wrote."""
    return reconcile.reconcile(body(spec, api.status), config or OperatorConfig(), api, failures)


def conditions(api: FakeClient) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in api.status["conditions"]}


def test_second_reconcile_writes_nothing(api: FakeClient) -> None:
    outcome = run(api, {"maxReplicas": 2})
    assert sorted(outcome.changes) == sorted(
        [
            "created Deployment/emb",
            "created Service/emb",
            "created PodDisruptionBudget/emb",
            "created HorizontalPodAutoscaler/emb",
            "created NetworkPolicy/emb",
        ]
    )
    api.calls = []
    again = run(api, {"maxReplicas": 2})
    assert (again.changes, api.writes()) == ([], [])  # converged: not even a status write
    # One read per child kind (a dict lookup in kopf's index in production), nothing else.
    assert sorted(api.calls) == sorted(("get", kind.plural) for kind in kinds.CHILDREN)


def test_quantities_the_server_rewrites_are_not_drift(api: FakeClient) -> None:
    run(api, {"resources": {"cpu": "4000m", "memory": "1024Mi", "gpu": 0}})
    deployment = api.objects["deployments", "ns", "emb"]
    # What a real API server stores: canonical quantities.
    deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4", "memory": "1Gi"}
    api.calls = []
    assert run(api, {"resources": {"cpu": "4000m", "memory": "1024Mi", "gpu": 0}}).changes == []
    assert api.writes() == []
    assert run(api, {"resources": {"cpu": "3", "memory": "1024Mi", "gpu": 0}}).changes == ["updated Deployment/emb"]


@pytest.mark.parametrize(("before", "after"), [("ClusterIP", "Headless"), ("Headless", "ClusterIP")])
def test_service_type_switch_replaces_the_service(api: FakeClient, before: str, after: str) -> None:
    run(api, {"service": {"type": before}})
    service = api.objects["services", "ns", "emb"]
    service["spec"].setdefault("clusterIP", "10.0.0.7")  # what the API server assigns to a ClusterIP one
    api.calls = []
    assert run(api, {"service": {"type": after}}).changes == ["replaced Service/emb"]
    assert [c for c in api.writes() if c[1] == "services"] == [("delete", "services"), ("create", "services")]
    assert (api.objects["services", "ns", "emb"]["spec"].get("clusterIP") == "None") == (after == "Headless")


def test_invalid_spec_keeps_the_children_and_reports(api: FakeClient) -> None:
    run(api, {})
    api.calls = []
    outcome = run(api, {"admission": {"p95SoftMs": 9000}})
    assert outcome.problem is not None and outcome.warnings == [outcome.problem]
    assert api.writes() == [("patch_status", "embeddingservices")]  # no child touched
    assert conditions(api)["Degraded"] == ("True", "InvalidSpec")
    assert api.status["observedGeneration"] == 2


OUT_OF_BOUNDS: dict[str, tuple[dict[str, Any], str, str]] = {
    # spec, the condition's reason, the field its message names
    "cpu Infinity": ({"resources": {"cpu": "Infinity"}}, "InvalidSpec", "spec.resources.cpu"),
    "cpu NaN": ({"resources": {"cpu": "NaN"}}, "InvalidSpec", "spec.resources.cpu"),
    "a model path out of its claim": (
        {"model": {"pvc": {"claimName": "m", "path": "../../etc"}}},
        "InvalidSpec",
        "spec.model.pvc.path",
    ),
    "a hub id that is a folder": ({"model": {"hub": {"id": "../models"}}}, "InvalidSpec", "spec.model.hub.id"),
    "replicas past the schema's ceiling": ({"maxReplicas": 2_000_000_000}, "InvalidSpec", "spec.maxReplicas"),
    "replicas past the operator's limit": ({"minReplicas": 101}, "ReplicasNotAllowed", "spec.minReplicas"),
    "an author's Prometheus": (
        {"maxReplicas": 2, "autoscaling": {"provider": "keda", "keda": {"serverAddress": "http://169.254.169.254"}}},
        "PrometheusAddressNotAllowed",
        "spec.autoscaling.keda.serverAddress",
    ),
}


@pytest.mark.parametrize(("spec", "reason", "field"), OUT_OF_BOUNDS.values(), ids=OUT_OF_BOUNDS.keys())
def test_a_spec_out_of_bounds_is_reported_not_retried(
    api: FakeClient, spec: dict[str, Any], reason: str, field: str
) -> None:
    """What an older CRD (or none) lets through: a condition naming the field, the children untouched,
    and no retry (Infinity once raised out of the render, and the loop retried it for ever)."""
    run(api, {})
    api.calls = []
    outcome = run(api, spec, config=OperatorConfig(keda_server_address="http://prometheus.monitoring.svc:9090"))
    assert outcome.error is None and outcome.problem is not None and outcome.warnings == [outcome.problem]
    assert api.writes() == [("patch_status", "embeddingservices")]
    assert conditions(api)["Degraded"] == ("True", reason)
    assert field in outcome.problem.message


def image_of(api: FakeClient) -> str:
    return str(api.objects["deployments", "ns", "emb"]["spec"]["template"]["spec"]["containers"][0]["image"])


def test_an_image_not_allowed_is_not_reconciled(api: FakeClient) -> None:
    config = OperatorConfig(allowed_images=("registry.example/kembed/*",))
    run(api, {}, config=config)
    assert image_of(api) == config.default_image
    api.calls = []
    outcome = run(api, {"image": "evil.example/miner:1", "minReplicas": 3}, config=config)
    assert api.writes() == [("patch_status", "embeddingservices")]  # no child touched: the old spec serves
    assert conditions(api)["Degraded"] == ("True", "ImageNotAllowed")
    assert conditions(api)["Ready"] == ("False", "ImageNotAllowed")
    assert conditions(api)["MetricsAdmitted"] == ("Unknown", "SpecNotApplied")
    assert outcome.problem is not None and "spec.image: 'evil.example/miner:1'" in outcome.problem.message
    assert outcome.warnings == [outcome.problem]  # a Warning event, once
    assert run(api, {"image": "evil.example/miner:1"}, config=config).warnings == []
    assert image_of(api) == config.default_image
    assert api.objects["deployments", "ns", "emb"]["spec"]["replicas"] == 1

    assert run(api, {"image": "registry.example/kembed/server:2"}, config=config).changes == ["updated Deployment/emb"]
    assert image_of(api) == "registry.example/kembed/server:2"
    assert conditions(api)["Degraded"] == ("False", "AsExpected")


def test_an_autoscaler_without_metrics_is_reported_once(api: FakeClient) -> None:
    outcome = run(api, {"maxReplicas": 3})
    assert conditions(api)["MetricsAdmitted"] == ("False", "NoMetricsPeers")
    assert [w.reason for w in outcome.warnings] == ["NoMetricsPeers"]
    assert conditions(api)["Degraded"] == ("False", "AsExpected")  # nor does it hold Ready
    assert conditions(api)["Ready"] == ("False", "RolloutInProgress")
    assert run(api, {"maxReplicas": 3}).warnings == []
    peers: dict[str, Any] = {"metricsFrom": [{"namespaceSelector": {}}]}
    assert run(api, {"maxReplicas": 3, "networkPolicy": peers}).warnings == []
    assert conditions(api)["MetricsAdmitted"] == ("True", "PeersAdmitted")


def test_the_operators_metrics_peers_admit_when_the_spec_names_none(api: FakeClient) -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    outcome = run(api, {"maxReplicas": 3}, config=OperatorConfig(metrics_from=(prometheus,)))
    assert (outcome.warnings, conditions(api)["MetricsAdmitted"]) == ([], ("True", "PeersAdmitted"))
    _, metrics_rule = api.objects["networkpolicies", "ns", "emb"]["spec"]["ingress"]
    assert metrics_rule["from"] == [prometheus]


def test_rejected_child_degrades(api: FakeClient) -> None:
    api.fail["create"] = ApiException(status=422, reason="Unprocessable Entity")
    outcome = run(api, {})
    assert outcome.problem is not None and outcome.problem.reason == "ApplyRejected"
    assert outcome.error is None  # a human must act: no retry loop
    assert conditions(api)["Degraded"] == ("True", "ApplyRejected")


def test_foreign_object_with_our_name_is_not_touched(api: FakeClient) -> None:
    api.objects["services", "ns", "emb"] = {"metadata": {"name": "emb", "ownerReferences": []}, "spec": {}}
    outcome = run(api, {})
    assert outcome.problem is not None and outcome.problem.reason == "NameConflict"
    assert ("apply", "services") not in api.writes()


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_transient_errors_ask_for_a_retry_and_degrade_from_the_second(api: FakeClient, status: int) -> None:
    api.fail["create"] = ApiException(status=status, reason="Flaky")
    first = run(api, {})
    assert first.error is not None and first.error.status == status
    assert conditions(api)["Degraded"][0] == "False"  # one failure retried at once is not a degradation
    second = run(api, {}, failures=1)
    assert second.error is not None
    assert conditions(api)["Degraded"] == ("True", "ApiUnavailable")
    assert conditions(api)["Ready"][0] == "False"
    del api.fail["create"]
    assert run(api, {}, failures=2).error is None
    assert conditions(api)["Degraded"] == ("False", "AsExpected")


def test_backoff_doubles_up_to_the_cap() -> None:
    for failures in range(1, 10):
        ceiling = min(handlers.MAX_BACKOFF_S, 2.0 ** (failures - 1))
        assert 0.75 * ceiling <= handlers.backoff(failures) <= ceiling


def test_retry_after_is_read_from_a_throttled_answer() -> None:
    throttled = ApiException(status=429, reason="Too Many Requests")
    throttled.headers = {"Retry-After": "7"}
    assert kube.retry_after(throttled) == 7.0
    assert kube.retry_after(ApiException(status=500)) == 0.0
    assert kube.retry_after(ValueError("a bug")) == 0.0
