"""Who may do what: the images a spec may name, and the operator's own settings from the chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kembed.config.values import ConfigError
from kembed.contract import OPERATOR_ENV_PREFIX as PREFIX
from kembed_operator import trust
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import parse_job_spec
from kembed_operator.spec import REPLICAS_CEILING, InvalidSpec, parse_spec

DEFAULT = "registry.example/kembed/kembed-server:1.0"

IMAGES = {
    # allowed patterns, the spec's image: allowed
    "no image named: the default": ((), "", True),
    "the default named again": ((), DEFAULT, True),
    "no patterns: nothing else": ((), "registry.example/kembed/kembed-server:1.1", False),
    "a repository's tags": (
        ("registry.example/kembed/kembed-server:*",),
        "registry.example/kembed/kembed-server:1.1",
        True,
    ),
    "a repository's digests": (
        ("registry.example/kembed/kembed-server@sha256:*",),
        "registry.example/kembed/kembed-server@sha256:" + "a" * 64,
        True,
    ),
    "the whole reference must match": (
        ("registry.example/kembed/*",),
        "evil.example/registry.example/kembed/x:1",
        False,
    ),
    "a lookalike registry": (("registry.example/kembed/*",), "registry.example.evil/kembed/x:1", False),
    "a lookalike path": (("registry.example/kembed/*",), "registry.example/kembedevil/x:1", False),
    "* spans paths": (("registry.example/kembed/*",), "registry.example/kembed/team/x:1", True),
    "any": (("*",), "docker.io/library/python:3", True),
    "one of several": (("a.example/*", "b.example/*"), "b.example/x:1", True),
}


@pytest.mark.parametrize(("patterns", "image", "allowed"), IMAGES.values(), ids=IMAGES.keys())
def test_images(patterns: tuple[str, ...], image: str, allowed: bool) -> None:
    config = OperatorConfig(default_image=DEFAULT, allowed_images=patterns)
    spec = parse_spec({"image": image})
    if allowed:
        trust.check_service(spec, config)
        return
    with pytest.raises(trust.NotAllowed, match=r"spec\.image") as refused:
        trust.check_service(spec, config)
    assert isinstance(refused.value, InvalidSpec) and refused.value.reason == "ImageNotAllowed"
    assert image in str(refused.value) and DEFAULT in str(refused.value)


POLICY = OperatorConfig(
    keda_server_address="http://prometheus.monitoring.svc:9090",
    allowed_env=("HF_TOKEN", "KEMBED_TRUST_REMOTE_CODE"),
    allowed_pod_annotations=("sidecar.istio.io/inject", "team.example/*"),
    allowed_tolerations=("dedicated",),
)
NVIDIA_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
ALLOWED_OPTIONS: dict[str, dict[str, Any]] = {
    "a server setting": {"env": [{"name": "KEMBED_LOG_LEVEL", "value": "DEBUG"}]},
    "a server setting from a Secret": {
        "env": [{"name": "KEMBED_MAX_WAIT_MS", "valueFrom": {"configMapKeyRef": {"name": "t", "key": "wait"}}}]
    },
    "inductor's compile workers": {"env": [{"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": "2"}]},
    "a name the chart allows": {
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]
    },
    "remote code the chart allows": {"env": [{"name": "KEMBED_TRUST_REMOTE_CODE", "value": "true"}]},
    "an annotation the chart names": {"podAnnotations": {"sidecar.istio.io/inject": "false"}},
    "an annotation a pattern matches": {"podAnnotations": {"team.example/owner": "search"}},
    "a taint the chart allows": {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}]},
    "node affinity": {"affinity": {"nodeAffinity": {}}},
    "pod anti-affinity": {"affinity": {"podAntiAffinity": {}}},
    "a node selector narrows only": {"nodeSelector": {"pool": "gpu"}},
    "the operator's own Prometheus, repeated": {
        "maxReplicas": 2,
        "autoscaling": {"provider": "keda", "keda": {"serverAddress": "http://prometheus.monitoring.svc:9090"}},
    },
    "as many replicas as the operator allows": {"minReplicas": 100},
}


@pytest.mark.parametrize("spec", ALLOWED_OPTIONS.values(), ids=ALLOWED_OPTIONS.keys())
def test_what_the_operator_allows(spec: dict[str, Any]) -> None:
    trust.check_service(parse_spec(spec), POLICY)


REFUSED: dict[str, tuple[dict[str, Any], str, str]] = {
    # spec, the condition's reason, the field the message names
    "PYTHONPATH into a claim": (
        {"env": [{"name": "PYTHONPATH", "value": "/models/evil"}]},
        "EnvNotAllowed",
        "spec.env[0]: PYTHONPATH",
    ),
    "LD_PRELOAD": ({"env": [{"name": "LD_PRELOAD", "value": "/models/x.so"}]}, "EnvNotAllowed", "spec.env[0]"),
    "HOME (a user site-packages)": ({"env": [{"name": "HOME", "value": "/models"}]}, "EnvNotAllowed", "HOME"),
    "a name from a Secret is still a name": (
        {"env": [{"name": "PYTHONSTARTUP", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
        "EnvNotAllowed",
        "spec.env[0]: PYTHONSTARTUP",
    ),
    "remote code": (
        {"env": [{"name": "KEMBED_TRUST_REMOTE_CODE", "value": "true"}]},
        "EnvNotAllowed",
        "KEMBED_TRUST_REMOTE_CODE runs the model's own code",
    ),
    "AppArmor unconfined": (
        {"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/server": "unconfined"}},
        "PodAnnotationNotAllowed",
        "spec.podAnnotations: 'container.apparmor",
    ),
    "a taint kept for others": (
        {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
        "TolerationNotAllowed",
        "spec.tolerations[0]: taint key 'node-role",
    ),
    "a KEMBED_ name that is no setting": (
        {"env": [{"name": "KEMBED_MAX_BATCH", "value": "8"}]},
        "EnvNotAllowed",
        "spec.env[0]: KEMBED_MAX_BATCH is not a kembed server setting",
    ),
    "every taint": ({"tolerations": [{"operator": "Exists"}]}, "TolerationNotAllowed", "every taint"),
    "the GPU taint is the operator's own to add": (
        {"tolerations": [NVIDIA_TAINT]},
        "TolerationNotAllowed",
        "spec.tolerations[0]",
    ),
    "pod affinity": (
        {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}},
        "AffinityNotAllowed",
        "spec.affinity.podAffinity",
    ),
    "KEDA fetching an internal URL": (
        {"maxReplicas": 2, "autoscaling": {"provider": "keda", "keda": {"serverAddress": "http://169.254.169.254"}}},
        "PrometheusAddressNotAllowed",
        "spec.autoscaling.keda.serverAddress: 'http://169.254.169.254'",
    ),
    "PromQL of the author's": (
        {"autoscaling": {"keda": {"serverAddress": "http://prometheus.monitoring.svc:9090/?query=up&"}}},
        "PrometheusAddressNotAllowed",
        "spec.autoscaling.keda.serverAddress",
    ),
    "more replicas than the operator allows": ({"minReplicas": 101}, "ReplicasNotAllowed", "spec.minReplicas: 101"),
    "autoscaling past the operator's limit": (
        {"maxReplicas": 2_000},
        "ReplicasNotAllowed",
        "spec.maxReplicas: 2000 replicas is more than the operator allows (100",
    ),
    "a compile cache on a claim": (
        {"compileCache": {"claimName": "shared"}},
        "CompileCacheClaimNotAllowed",
        "spec.compileCache.claimName",
    ),
}


@pytest.mark.parametrize(("spec", "reason", "field"), REFUSED.values(), ids=REFUSED.keys())
def test_what_the_operator_refuses(spec: dict[str, Any], reason: str, field: str) -> None:
    config = OperatorConfig(allowed_tolerations=("dedicated",), keda_server_address=POLICY.keda_server_address)
    with pytest.raises(trust.NotAllowed) as refused:
        trust.check_service(parse_spec(spec), config)
    assert refused.value.reason == reason
    assert field in str(refused.value)


def test_every_refusal_is_named_at_once() -> None:
    spec = parse_spec(
        {
            "image": "evil.example/x:1",
            "env": [{"name": "KEMBED_LOG_LEVEL", "value": "INFO"}, {"name": "LD_PRELOAD", "value": "/x"}],
            "podAnnotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"},
        }
    )
    with pytest.raises(trust.NotAllowed) as refused:
        trust.check_service(spec, OperatorConfig())
    assert [r.reason for r in refused.value.refusals] == ["ImageNotAllowed", "EnvNotAllowed", "PodAnnotationNotAllowed"]
    assert refused.value.reason == "ImageNotAllowed"
    assert "spec.env[1]: LD_PRELOAD" in str(refused.value) and "spec.env[0]" not in str(refused.value)


def test_the_chart_may_raise_the_replica_limit() -> None:
    trust.check_service(parse_spec({"maxReplicas": 5_000}), OperatorConfig(max_replicas=5_000))


def test_the_chart_may_allow_compile_cache_claims() -> None:
    spec = parse_spec({"compileCache": {"claimName": "shared"}})
    trust.check_service(spec, OperatorConfig(allow_compile_cache_claims=True))


JOB = {"service": "emb", "input": {"claimName": "c", "path": "in.txt"}, "output": {"claimName": "c", "path": "o.npy"}}


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"env": [{"name": "KEMBED_LOG_LEVEL", "value": "DEBUG"}]}, "EnvNotAllowed"),  # the client reads no setting
        ({"env": [{"name": "PYTHONPATH", "value": "/data/c"}]}, "EnvNotAllowed"),
        ({"env": [{"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": "1"}]}, "EnvNotAllowed"),
        (
            {"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/embed": "unconfined"}},
            "PodAnnotationNotAllowed",
        ),
        ({"tolerations": [{"key": "dedicated"}]}, "TolerationNotAllowed"),
        ({"affinity": {"podAffinity": {}}}, "AffinityNotAllowed"),
    ],
    ids=["server-setting", "pythonpath", "compile-threads", "apparmor", "toleration", "pod-affinity"],
)
def test_an_embedding_jobs_pods_follow_the_same_rules(options: dict[str, Any], reason: str) -> None:
    with pytest.raises(trust.NotAllowed) as refused:
        trust.check_job(parse_job_spec({**JOB, **options}), DEFAULT, OperatorConfig(default_image=DEFAULT))
    assert refused.value.reason == reason


def test_an_embedding_jobs_allowed_options_and_image() -> None:
    config = OperatorConfig(default_image=DEFAULT, allowed_env=("HF_HUB_OFFLINE",), allowed_tolerations=("*",))
    spec = parse_job_spec({**JOB, "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}], "tolerations": [{"key": "x"}]})
    trust.check_job(spec, DEFAULT, config)
    with pytest.raises(trust.NotAllowed, match=r"spec\.image: 'evil\.example/x:1'"):
        trust.check_job(spec, "evil.example/x:1", config)


def test_settings_from_the_chart() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    config = OperatorConfig.from_env(
        {PREFIX + "ALLOWED_IMAGES": " a.example/*, b.example/x:* ,", PREFIX + "METRICS_FROM": json.dumps(peers)}
    )
    assert config.allowed_images == ("a.example/*", "b.example/x:*")
    assert config.metrics_from == tuple(peers)
    assert OperatorConfig.from_env({}) == OperatorConfig()


@pytest.mark.parametrize(
    "text", ["{", '{"podSelector": {}}', "[1]", "[{}]", '[{"podSelector": {}, "ports": []}]'], ids=str
)
def test_malformed_metrics_peers_name_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=PREFIX + "METRICS_FROM"):
        OperatorConfig.from_env({PREFIX + "METRICS_FROM": text})


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("MAX_REPLICAS", "0"),
        ("MAX_REPLICAS", "ten"),
        ("PEERING_LIFETIME_S", "0"),
        ("ALLOW_COMPILE_CACHE_CLAIMS", "yes"),
        ("ALLOWED_AFFINITY", "nodeAffinity,anyAffinity"),
        ("KEDA_SERVER_ADDRESS", "http://prom:9090/?q=1"),
        ("OTLP_ENDPOINT", "otel-collector:4318"),
        ("OTLP_ENDPOINT", "http://otel-collector:4318/?a=b"),
        ("TRACE_SAMPLE_RATIO", "1.5"),
        ("TRACE_SAMPLE_RATIO", "nan"),
        ("MAX_REPLICA", "5"),  # a typo is no setting, not a silent default
    ],
)
def test_a_bad_operator_setting_names_its_variable(variable: str, text: str) -> None:
    with pytest.raises(ConfigError, match=f"^{PREFIX}{variable}: "):
        OperatorConfig.from_env({PREFIX + variable: text})


@pytest.mark.process
def test_a_bad_operator_setting_stops_kopf_run_naming_it() -> None:
    """Read in kopf's start-up handler: a bad value fails it for good, and `kopf run` exits."""
    env = {**os.environ, PREFIX + "MAX_REPLICAS": "0", "KUBECONFIG": "/nonexistent"}
    command = [sys.executable, "-m", "kopf", "run", "-m", "kembed_operator.handlers", "--standalone", "-A"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"failed permanently: {PREFIX}MAX_REPLICAS" in done.stderr


def test_pod_policy_from_the_chart() -> None:
    config = OperatorConfig.from_env(
        {
            PREFIX + "ALLOWED_ENV": "HF_TOKEN,HF_HUB_OFFLINE",
            PREFIX + "ALLOWED_POD_ANNOTATIONS": "sidecar.istio.io/*",
            PREFIX + "ALLOWED_TOLERATIONS": "dedicated,pool",
            PREFIX + "ALLOWED_AFFINITY": "nodeAffinity",
            PREFIX + "ALLOW_COMPILE_CACHE_CLAIMS": "true",
        }
    )
    assert config.allowed_env == ("HF_TOKEN", "HF_HUB_OFFLINE")
    assert config.allowed_pod_annotations == ("sidecar.istio.io/*",)
    assert config.allowed_tolerations == ("dedicated", "pool")
    assert config.allowed_affinity == ("nodeAffinity",)
    assert config.allow_compile_cache_claims is True
    assert OperatorConfig.from_env({PREFIX + "ALLOWED_AFFINITY": ""}).allowed_affinity == ()


@pytest.mark.parametrize(
    ("name", "text"), [("ALLOWED_AFFINITY", "nodeAffinity,podAfinity"), ("ALLOW_COMPILE_CACHE_CLAIMS", "yes")]
)
def test_malformed_pod_policy_names_the_variable(name: str, text: str) -> None:
    with pytest.raises(ValueError, match=PREFIX + name):
        OperatorConfig.from_env({PREFIX + name: text})


@pytest.mark.parametrize(
    "text", ["prometheus:9090", "ftp://prometheus", "http://", "http://p/?query=up&", "http://p#x"]
)
def test_the_prometheus_address_is_an_http_url_to_append_a_query_to(text: str) -> None:
    with pytest.raises(ValueError, match=PREFIX + "KEDA_SERVER_ADDRESS"):
        OperatorConfig.from_env({PREFIX + "KEDA_SERVER_ADDRESS": text})


@pytest.mark.parametrize("text", ["0", "lots", "-1", f"{REPLICAS_CEILING + 1}"])
def test_the_replica_limit_is_under_the_schemas_ceiling(text: str) -> None:
    with pytest.raises(ValueError, match=PREFIX + "MAX_REPLICAS"):
        OperatorConfig.from_env({PREFIX + "MAX_REPLICAS": text})
