"""The Helm chart, offline: lint, render, validate every manifest, RBAC equal to what the operator calls."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest

from kembed.contract import OPERATOR_ENV_PREFIX as PREFIX
from kembed_operator import permissions, render
from kembed_operator.config import OperatorConfig
from kembed_operator.spec import OTLP_ENDPOINT_MAX_LENGTH, OTLP_ENDPOINT_PATTERN, REPLICAS_CEILING, parse_spec
from tests.operator.conftest import CHART, CRD_PATH, ROOT, chart_operator_args, render_chart

K8S_VERSION = "1.34.0"
# CRD kinds: no built-in schema to validate with (test_monitoring.py checks the PrometheusRule's shape).
CUSTOM_KINDS = {"ClusterKopfPeering", "KopfPeering", "PodMonitor", "PrometheusRule"}
ERROR = 3
SERVED = ["team-a", "team-b"]
NAMESPACED = {"watchNamespaces": SERVED}
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in docs}


def every(kind: str, docs: list[dict[str, Any]]) -> dict[str | None, dict[str, Any]]:
    """The documents of one kind, by namespace."""
    return {doc["metadata"].get("namespace"): doc for doc in docs if doc["kind"] == kind}


def granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, res, verb)
        for r in role["rules"]
        for group in r["apiGroups"]
        for res in r["resources"]
        for verb in r["verbs"]
    }


def test_lint_is_clean() -> None:
    result = helm_python.lint(str(CHART), kube_version="v1.34.0")
    assert [m for m in result["messages"] if m["severity"] >= ERROR] == []
    assert not result["errors"]


CLUSTER_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "ClusterKopfPeering"}
NAMESPACED_KINDS = {"ServiceAccount", "Role", "RoleBinding", "Deployment", "KopfPeering"}


@pytest.mark.parametrize(
    ("values", "kinds"),
    [
        ({}, CLUSTER_KINDS),
        ({"podMonitor": {"enabled": True}, "replicaCount": 1}, CLUSTER_KINDS | {"PodMonitor"}),
        ({**NAMESPACED, "podMonitor": {"enabled": True}}, NAMESPACED_KINDS | {"PodMonitor"}),
        ({"allowedImages": ["registry.example/kembed/*"], "metricsFrom": [PROMETHEUS]}, CLUSTER_KINDS),
        (
            {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}},
            CLUSTER_KINDS | {"ConfigMap", "PrometheusRule"},
        ),
    ],
    ids=["default", "podmonitor", "namespaced", "trust", "monitoring"],
)
def test_every_manifest_is_valid_kubernetes(values: dict[str, Any], kinds: set[str]) -> None:
    docs = render_chart(values)
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert set(by_kind(docs)) == kinds


def test_crds_are_valid_kubernetes() -> None:
    import yaml

    for path in sorted((CHART / "crds").glob("*.yaml")):
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), K8S_VERSION, strict=True)
    assert (CHART / "crds" / CRD_PATH.name).exists()


def test_rbac_is_exactly_what_the_operator_calls() -> None:
    docs = render_chart()
    assert granted(by_kind(docs)["ClusterRole"]) == permissions.triples(permissions.CLUSTER_WIDE)
    binding = by_kind(docs)["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == by_kind(docs)["ServiceAccount"]["metadata"]["name"]


def test_a_namespaced_install_grants_roles_in_the_served_namespaces_only() -> None:
    docs = render_chart(NAMESPACED)
    assert not {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"} & set(by_kind(docs))
    roles, bindings = every("Role", docs), every("RoleBinding", docs)
    assert set(roles) == set(bindings) == set(SERVED)
    account = by_kind(docs)["ServiceAccount"]["metadata"]
    for namespace in SERVED:
        assert granted(roles[namespace]) == permissions.triples(permissions.NAMESPACED)
        ((subject,), ref) = bindings[namespace]["subjects"], bindings[namespace]["roleRef"]
        assert (subject["name"], subject["namespace"]) == (account["name"], account["namespace"])
        assert (ref["kind"], ref["name"]) == ("Role", roles[namespace]["metadata"]["name"])
    args = chart_operator_args(NAMESPACED)
    assert [a for a in args if a.startswith("--namespace=")] == [f"--namespace={ns}" for ns in SERVED]
    assert "--all-namespaces" not in args
    peering = next(a.split("=", 1)[1] for a in args if a.startswith("--peering="))
    assert {ns: p["metadata"]["name"] for ns, p in every("KopfPeering", docs).items()} == dict.fromkeys(SERVED, peering)
    monitor = by_kind(render_chart({**NAMESPACED, "podMonitor": {"enabled": True}}))["PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": SERVED}


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
    ipv6 = chart_operator_args({"healthAddress": "[::]"})  # a cluster whose pods' primary address is IPv6
    assert "--liveness=http://[::]:8080/healthz" in ipv6 and "--liveness=http://0.0.0.0:8080/healthz" in args
    env = {e["name"]: e["value"] for e in container["env"]}
    assert OperatorConfig.from_env(env) == OperatorConfig()  # the chart's defaults are the operator's
    assert set(env) == {PREFIX + name.upper() for name in OperatorConfig.model_fields}


TRUST: dict[str, Any] = {
    "allowedImages": ["registry.example/kembed/*", "ghcr.io/x/y:*"],
    "metricsFrom": [PROMETHEUS],
    "allowedEnv": ["HF_TOKEN", "HF_HUB_OFFLINE"],
    "allowedPodAnnotations": ["sidecar.istio.io/*"],
    "allowedTolerations": ["dedicated", "*"],
    "allowedAffinity": ["nodeAffinity", "podAffinity"],
    "allowCompileCacheClaims": True,
    "maxReplicas": 500,
    "kedaServerAddress": "http://prometheus.monitoring.svc:9090",
}


def test_trust_settings_reach_the_operator() -> None:
    (deployment,) = [d for d in render_chart(TRUST) if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = OperatorConfig.from_env(env)
    assert config.allowed_images == tuple(TRUST["allowedImages"])
    assert config.metrics_from == (PROMETHEUS,)
    assert config.allowed_env == ("HF_TOKEN", "HF_HUB_OFFLINE")
    assert config.allowed_pod_annotations == ("sidecar.istio.io/*",)
    assert config.allowed_tolerations == ("dedicated", "*")
    assert config.allowed_affinity == ("nodeAffinity", "podAffinity")
    assert config.allow_compile_cache_claims is True
    assert (config.max_replicas, config.keda_server_address) == (500, TRUST["kedaServerAddress"])


def operator_env(values: dict[str, Any]) -> dict[str, str]:
    (deployment,) = [d for d in render_chart(values) if d["kind"] == "Deployment"]
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_charts_tracing_reaches_every_server_that_names_no_endpoint() -> None:
    """Chart values -> the operator's settings -> a resource's server container, which names none itself."""
    tracing = {"otlpEndpoint": "http://otel-collector.observability:4318", "sampleRatio": 0.05}
    config = OperatorConfig.from_env(operator_env({"tracing": tracing}))
    assert (config.otlp_endpoint, config.trace_sample_ratio) == (tracing["otlpEndpoint"], 0.05)
    owner = render.Owner(name="emb", namespace="search", uid="u")
    (deployment,) = [c.manifest for c in render.render(owner, parse_spec({}), config) if c.kind.kind == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == tracing["otlpEndpoint"]
    assert (env["OTEL_SERVICE_NAME"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("emb", "0.05")
    assert OperatorConfig.from_env(operator_env({"tracing": {"sampleRatio": 0}})).trace_sample_ratio == 0


def test_the_charts_endpoint_rule_is_the_crds() -> None:
    """values.schema.json takes the endpoint a resource's spec.tracing.otlpEndpoint may be, or nothing."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    endpoint = schema["properties"]["tracing"]["properties"]["otlpEndpoint"]
    assert endpoint["pattern"] == f"^({OTLP_ENDPOINT_PATTERN.removeprefix('^').removesuffix('$')})?$"
    assert endpoint["maxLength"] == OTLP_ENDPOINT_MAX_LENGTH


# Where the docs tell how to install the operator: each `helm install` of the chart, followed literally.
INSTALL_DOCS = [ROOT / "README.md", ROOT / "docs" / "operator.md", CHART / "README.md"]
HELM_INSTALL = re.compile(r"^helm install kembed-operator charts/kembed-operator\b(?:.*\\\n)*.*$", re.MULTILINE)


def documented_installs() -> list[tuple[str, dict[str, Any]]]:
    """(where, the values its flags set) for every documented `helm install` of the chart, parsed by
    Helm's own --set and --set-json parsers."""
    installs = []
    for doc in INSTALL_DOCS:
        for match in HELM_INSTALL.finditer(doc.read_text()):
            args = shlex.split(match.group(0).replace("\\\n", " "))
            values: dict[str, Any] = {}
            for flag, expression in itertools.pairwise(args):
                if flag == "--set":
                    merge(values, helm_python.parse_set_string(expression))
                elif flag == "--set-json":
                    merge(values, helm_python.parse_set_json(expression))
            installs.append((f"{doc.relative_to(ROOT)}:{match.group(0)[:40]}...", values))
    return installs


def merge(values: dict[str, Any], more: dict[str, Any]) -> None:
    """``more`` into ``values``, nested maps key by key, as Helm merges repeated flags."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            merge(values[key], value)
        else:
            values[key] = value


def test_every_documented_install_admits_prometheus_to_the_metrics() -> None:
    installs = documented_installs()
    assert {Path(where.split(":")[0]) for where, _ in installs} == {doc.relative_to(ROOT) for doc in INSTALL_DOCS}
    for where, values in installs:
        (deployment,) = [d for d in render_chart(values) if d["kind"] == "Deployment"]
        env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        # Empty, every autoscaled resource reports MetricsAdmitted=False and its autoscaler gets no metrics.
        assert OperatorConfig.from_env(env).metrics_from == (PROMETHEUS,), where


def test_the_charts_replica_limit_stops_at_the_crds_ceiling() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["maxReplicas"]["maximum"] == REPLICAS_CEILING


def test_the_notes_name_both_resources_and_what_env_may_set() -> None:
    notes = next(
        text
        for path, text in helm_python.Chart.load(str(CHART))
        .render({"allowedEnv": ["HF_TOKEN"]}, name="kembed", namespace="kembed-system", is_install=True)
        .items()
        if path.endswith("NOTES.txt")
    )
    assert "EmbeddingJob" in notes and "examples/embeddingjob.yaml" in notes and "docs/corpus-jobs.md" in notes
    assert "spec.env may set: HF_TOKEN." in notes


@pytest.mark.parametrize(
    "values",
    [
        {"replicaCount": 0},
        {"image": {"pullPolicy": "Sometimes"}},
        {"podMonitor": {"interval": "soon"}},
        {"typo": 1},
        {"watchNamespaces": ["Team_A"]},
        {"watchNamespaces": ["a", "a"]},
        {"allowedImages": ["a.example/*,b.example/*"]},
        {"metricsFrom": [{"namespaceSelector": {}, "ports": [8001]}]},
        {"metricsFrom": [{}]},
        {"allowedEnv": ["HF_TOKEN,PYTHONPATH"]},
        {"allowedAffinity": ["podAfinity"]},
        {"allowCompileCacheClaims": "yes"},
        {"kedaServerAddress": "http://prometheus:9090/?query=up&"},
        {"maxReplicas": 100_000},
        {"tracing": {"otlpEndpoint": "otel-collector:4318"}},
        {"tracing": {"otlpEndpoint": "http://otel-collector:4318/?tenant=a"}},
        {"tracing": {"sampleRatio": 2}},
        {"tracing": {"headers": "x"}},
    ],
    ids=[
        "zero-replicas",
        "pull-policy",
        "interval",
        "unknown-key",
        "namespace-name",
        "namespace-twice",
        "image-list-in-one",
        "peer-with-ports",
        "empty-peer",
        "env-list-in-one",
        "affinity-kind",
        "compile-cache-flag",
        "prometheus-with-a-query",
        "replicas-past-the-ceiling",
        "otlp-endpoint-not-a-url",
        "otlp-endpoint-with-a-query",
        "sample-ratio-over-one",
        "tracing-unknown-key",
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=r"(?i)schema|validat"):
        render_chart(values)
