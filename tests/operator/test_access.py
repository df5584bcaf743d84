"""Render: the TLS Secret mounts and variables, and the NetworkPolicy; every manifest strictly valid
Kubernetes 1.34, every spec valid for the CRD's schema."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from kembed.config.settings import Settings
from kembed.contract import GRPC_PORT, HTTP_PORT, REST_PORT, env_name
from kembed_operator import access, kinds, permissions, render
from kembed_operator.config import OperatorConfig
from kembed_operator.spec import InvalidSpec, parse_spec
from tests.operator.test_crd import apply_defaults, as_json_schema, resource
from tests.operator.test_render import CONFIG, K8S_VERSION, OWNER, children, container, env

PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
WEB = {"namespaceSelector": {"matchLabels": {"team": "web"}}}
OFFICE = {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}

SPECS: dict[str, dict[str, Any]] = {
    "tls": {"tls": {"secretName": "emb-tls"}},
    "mtls": {"tls": {"secretName": "emb-tls", "clientCASecretName": "clients-ca"}},
    "api key": {"apiKey": {"secretName": "emb-keys"}},
    "peers": {"networkPolicy": {"from": [WEB, OFFICE], "metricsFrom": [PROMETHEUS]}},
    "no policy": {"networkPolicy": {"enabled": False}},
}

API_PORTS = [{"protocol": "TCP", "port": GRPC_PORT}, {"protocol": "TCP", "port": REST_PORT}]  # gRPC and REST alike


def pod(spec: dict[str, Any]) -> dict[str, Any]:
    return dict(children(spec)["Deployment"]["spec"]["template"]["spec"])


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_manifests_are_valid_kubernetes_and_specs_valid_for_the_crd(
    spec: dict[str, Any], crd_schema: dict[str, Any]
) -> None:
    jsonschema.Draft4Validator(as_json_schema(crd_schema)).validate(resource(spec))
    defaulted = apply_defaults(crd_schema["properties"]["spec"], spec)
    for child in render.render(OWNER, parse_spec(defaulted), CONFIG):
        kubernetes_validate.validate(child.manifest, K8S_VERSION, strict=True)


def test_tls_mounts_the_secret_read_only_and_sets_the_variables() -> None:
    spec = SPECS["tls"]
    assert {
        "name": "tls",
        "secret": {
            "secretName": "emb-tls",
            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
            "defaultMode": 0o440,
        },
    } in pod(spec)["volumes"]
    mounts = container(spec)["volumeMounts"]
    assert {"name": "tls", "mountPath": access.TLS_DIR, "readOnly": True} in mounts
    assert not any("subPath" in mount for mount in mounts)  # a subPath mount never sees a renewal
    variables = env(spec)
    assert variables[env_name("tls_cert_file")] == f"{access.TLS_DIR}/tls.crt"
    assert variables[env_name("tls_key_file")] == f"{access.TLS_DIR}/tls.key"
    assert env_name("tls_client_ca_file") not in variables
    assert Settings.from_env({k: v for k, v in variables.items() if k.startswith("KEMBED_")}).tls
    # Probes stay plain HTTP on the metrics port: kubelets do not present client certificates.
    assert container(spec)["readinessProbe"]["httpGet"]["port"] == "http"


def test_mtls_mounts_only_the_ca_certificate() -> None:
    spec = SPECS["mtls"]
    client_ca = next(v for v in pod(spec)["volumes"] if v["name"] == "client-ca")
    assert client_ca["secret"]["secretName"] == "clients-ca"
    assert client_ca["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the CA's key
    assert {"name": "client-ca", "mountPath": access.CLIENT_CA_DIR, "readOnly": True} in container(spec)["volumeMounts"]
    assert env(spec)[env_name("tls_client_ca_file")] == f"{access.CLIENT_CA_DIR}/ca.crt"


def test_no_tls_mounts_nothing() -> None:
    assert [v["name"] for v in pod({})["volumes"]] == ["tmp", "compile-cache"]  # no TLS volume
    assert not any(name.startswith("KEMBED_TLS_") for name in env({}))


def test_an_api_key_mounts_the_secrets_one_key_read_only_and_names_the_file() -> None:
    spec = {"apiKey": {"secretName": "emb-keys", "key": "search-keys"}}
    (volume,) = [v for v in pod(spec)["volumes"] if "secret" in v]
    assert volume == {
        "name": "api-key",
        "secret": {
            "secretName": "emb-keys",
            "items": [{"key": "search-keys", "path": "search-keys"}],
            "defaultMode": 0o440,
        },
    }
    mounts = container(spec)["volumeMounts"]
    assert {"name": "api-key", "mountPath": access.API_KEY_DIR, "readOnly": True} in mounts
    assert not any("subPath" in mount for mount in mounts)  # a subPath mount never sees a rotated key
    assert env(spec)["KEMBED_API_KEY_FILE"] == f"{access.API_KEY_DIR}/search-keys"
    assert env(SPECS["api key"])["KEMBED_API_KEY_FILE"] == f"{access.API_KEY_DIR}/api-keys"  # the key's default
    assert "KEMBED_API_KEY_FILE" not in env({})
    assert not any("secret" in volume for volume in pod({})["volumes"])
    # Probes stay on the open health port; the operator names the Secret and never reads one.
    assert container(spec)["readinessProbe"]["httpGet"]["port"] == "http"
    rules = permissions.CLUSTER_WIDE + permissions.NAMESPACED
    assert not any(rule.resource == "secrets" for rule in rules)


@pytest.mark.parametrize(
    ("spec", "expected"), [({}, "plaintext"), (SPECS["tls"], "tls"), (SPECS["mtls"], "mtls")], ids=str
)
def test_transport_tells_clients_what_to_speak(spec: dict[str, Any], expected: str) -> None:
    assert access.transport(parse_spec(spec)) == expected


def test_the_default_policy_admits_grpc_from_its_own_namespace_only() -> None:
    rendered = children({})
    policy = rendered["NetworkPolicy"]
    assert policy["metadata"] == rendered["Service"]["metadata"]  # named, labelled and owned like every child
    assert policy["spec"]["podSelector"]["matchLabels"] == rendered["Deployment"]["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}], "ports": API_PORTS}]
    ports = {p["name"]: p["containerPort"] for p in container({})["ports"]}
    assert ports == {"grpc": GRPC_PORT, "rest": REST_PORT, "http": HTTP_PORT}  # the ports the policy names


def test_peers_add_grpc_callers_and_metrics_scrapers() -> None:
    grpc_rule, metrics_rule = children(SPECS["peers"])["NetworkPolicy"]["spec"]["ingress"]
    assert grpc_rule == {"from": [{"podSelector": {}}, WEB, OFFICE], "ports": API_PORTS}
    assert metrics_rule == {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}


def test_the_operators_metrics_peers_fill_in_for_an_empty_metrics_from() -> None:
    config = OperatorConfig(metrics_from=(PROMETHEUS,))
    policy_spec = access.network_policy_spec({"app": "emb"}, parse_spec({}), config)
    policy: dict[str, Any] = {
        "apiVersion": kinds.NETWORK_POLICY.api_version,
        "kind": kinds.NETWORK_POLICY.kind,
        "metadata": {"name": "emb", "namespace": "search"},
        "spec": policy_spec,
    }
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["ingress"][1] == {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}
    own = parse_spec({"networkPolicy": {"metricsFrom": [OFFICE]}})
    assert access.metrics_peers(own, config) == [OFFICE]  # the spec's own peers replace the default


METRICS_CASES = {
    # spec, the operator's default peers: (status, reason, a Warning event)
    "autoscaled, no peers anywhere": ({"maxReplicas": 3}, (), (False, "NoMetricsPeers", True)),
    "fixed size, no peers": ({}, (), (False, "NoMetricsPeers", False)),
    "autoscaling disabled, no peers": (
        {"maxReplicas": 3, "autoscaling": {"enabled": False}},
        (),
        (False, "NoMetricsPeers", False),
    ),
    "the spec's peers": (
        {"maxReplicas": 3, "networkPolicy": {"metricsFrom": [PROMETHEUS]}},
        (),
        (True, "PeersAdmitted", False),
    ),
    "the operator's peers": ({"maxReplicas": 3}, (PROMETHEUS,), (True, "PeersAdmitted", False)),
    "no policy": ({"maxReplicas": 3, "networkPolicy": {"enabled": False}}, (), (True, "NoNetworkPolicy", False)),
}


@pytest.mark.parametrize(("spec", "default", "expected"), METRICS_CASES.values(), ids=METRICS_CASES.keys())
def test_metrics_admitted(spec: dict[str, Any], default: tuple[dict[str, Any], ...], expected: tuple[Any, ...]) -> None:
    verdict = access.metrics_admitted(parse_spec(spec), OperatorConfig(metrics_from=default))
    assert (verdict.holds, verdict.reason, verdict.alarming) == expected
    if not verdict.holds:
        assert "spec.networkPolicy.metricsFrom" in verdict.message
        assert ("autoscaler" in verdict.message) == verdict.alarming


def test_a_disabled_policy_is_not_rendered() -> None:
    assert "NetworkPolicy" not in children(SPECS["no policy"])
    assert kinds.NETWORK_POLICY in kinds.CHILDREN  # ...so a reconcile deletes one made before


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "mtls without a server certificate": ({"tls": {"clientCASecretName": "ca"}}, "spec.tls.secretName"),
    "empty secret name": ({"tls": {"secretName": ""}}, "spec.tls.secretName"),
    "env fights tls": (
        {"tls": {"secretName": "s"}, "env": [{"name": "KEMBED_TLS_CERT_FILE", "value": "/x"}]},
        r"spec\.env\[0\]",
    ),
    "peers not a list": ({"networkPolicy": {"from": WEB}}, "spec.networkPolicy.from"),
    "api key without a secret": ({"apiKey": {"key": "k"}}, "spec.apiKey.secretName"),
    "api key not a secret key": ({"apiKey": {"secretName": "s", "key": "a/b"}}, "spec.apiKey.key"),
    "env fights the api key": ({"env": [{"name": "KEMBED_API_KEY_FILE", "value": "/x"}]}, r"spec\.env\[0\]"),
}


@pytest.mark.parametrize(("spec", "needle"), INVALID.values(), ids=INVALID.keys())
def test_invalid_specs_are_explained(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidSpec, match=needle):
        render.render(OWNER, parse_spec(spec), CONFIG)


BAD_FOR_THE_SCHEMA: dict[str, dict[str, Any]] = {
    "tls without a secret": {"tls": {"clientCASecretName": "ca"}},
    "ipBlock without cidr": {"networkPolicy": {"from": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}},
    "enabled as text": {"networkPolicy": {"enabled": "yes"}},
    "metricsFrom not a list": {"networkPolicy": {"metricsFrom": PROMETHEUS}},
    "api key without a secret": {"apiKey": {"key": "api-keys"}},
    "api key not a secret key": {"apiKey": {"secretName": "s", "key": "../x"}},
}


@pytest.mark.parametrize("spec", BAD_FOR_THE_SCHEMA.values(), ids=BAD_FOR_THE_SCHEMA.keys())
def test_the_crd_rejects(spec: dict[str, Any], crd_schema: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(as_json_schema(crd_schema)).validate(resource(spec))
