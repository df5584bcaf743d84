"""The Helm chart, offline: lint, render, validate every manifest, RBAC equal to what the operator calls."""

from __future__ import annotations

import dataclasses
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from kembed_operator import permissions
from kembed_operator.config import PREFIX, OperatorConfig
from tests.operator.conftest import CHART, CRD_PATH, chart_operator_args, render_chart

K8S_VERSION = "1.34.0"
CUSTOM_KINDS = {"ClusterKopfPeering", "PodMonitor"}  # CRD kinds: no built-in schema to validate with
ERROR = 3


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in docs}


def test_lint_is_clean() -> None:
    result = helm_python.lint(str(CHART), kube_version="v1.34.0")
    assert [m for m in result["messages"] if m["severity"] >= ERROR] == []
    assert not result["errors"]


@pytest.mark.parametrize(
    "values", [{}, {"podMonitor": {"enabled": True}, "replicaCount": 1}], ids=["default", "podmonitor"]
)
def test_every_manifest_is_valid_kubernetes(values: dict[str, Any]) -> None:
    docs = render_chart(values)
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    expected = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "ClusterKopfPeering"}
    assert set(by_kind(docs)) == expected | ({"PodMonitor"} if values else set())


def test_crds_are_valid_kubernetes() -> None:
    import yaml

    for path in sorted((CHART / "crds").glob("*.yaml")):
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), K8S_VERSION, strict=True)
    assert (CHART / "crds" / CRD_PATH.name).exists()


def test_rbac_is_exactly_what_the_operator_calls() -> None:
    role = by_kind(render_chart())["ClusterRole"]
    granted = {
        (group, res, verb)
        for r in role["rules"]
        for group in r["apiGroups"]
        for res in r["resources"]
        for verb in r["verbs"]
    }
    assert granted == permissions.triples()
    binding = by_kind(render_chart())["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == by_kind(render_chart())["ServiceAccount"]["metadata"]["name"]


def test_operator_deployment() -> None:
    deployment = by_kind(render_chart())["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    args = chart_operator_args()
    assert "--module=kembed_operator.handlers" in args and "--all-namespaces" in args
    peering = next(a.split("=", 1)[1] for a in args if a.startswith("--peering="))
    assert by_kind(render_chart())["ClusterKopfPeering"]["metadata"]["name"] == peering
    liveness = next(a for a in args if a.startswith("--liveness="))
    assert liveness.endswith(
        f":{container['ports'][0]['containerPort']}{container['livenessProbe']['httpGet']['path']}"
    )
    env = {e["name"]: e["value"] for e in container["env"]}
    assert OperatorConfig.from_env(env) == OperatorConfig()  # the chart's defaults are the operator's
    assert set(env) == {PREFIX + f.name.upper() for f in dataclasses.fields(OperatorConfig)}


@pytest.mark.parametrize(
    "values",
    [{"replicaCount": 0}, {"image": {"pullPolicy": "Sometimes"}}, {"podMonitor": {"interval": "soon"}}, {"typo": 1}],
    ids=["zero-replicas", "pull-policy", "interval", "unknown-key"],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=r"(?i)schema|validat"):
        render_chart(values)
