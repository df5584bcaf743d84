"""Render: every spec feature, every manifest validated against Kubernetes 1.34 (strict)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest
from kubernetes.utils.quantity import parse_quantity

from kembed.config.settings import Settings
from kembed.contract import GRPC_PORT, HTTP_PORT, LIVEZ_PATH, METRICS_PATH, READYZ_PATH, REST_PORT, Metric, env_name
from kembed_operator import identity, kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.slo import derive
from kembed_operator.spec import InvalidSpec, parse_spec

K8S_VERSION = "1.34.0"
OWNER = render.Owner(name="emb", namespace="search", uid="0000-1111")
CONFIG = OperatorConfig(default_image="registry.example/kembed-server:9", keda_server_address="http://prom:9090")

COLLECTOR = "http://otel-collector.observability:4318"
OTEL = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"}

FEATURES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "pvc model": {"model": {"pvc": {"claimName": "models", "path": "bge"}, "pooling": "cls", "dtype": "float16"}},
    "hub model, emptyDir cache": {"model": {"hub": {"id": "BAAI/bge-small-en-v1.5", "revision": "main"}}},
    "hub model, PVC cache": {"model": {"hub": {"id": "intfloat/e5-small", "cacheClaimName": "hf-cache"}}},
    "control tokens": {"model": {"controlTokens": ["[query]", "[doc]"], "maxInputTokens": 256}},
    "a default prompt": {"model": {"defaultPromptName": "query"}},
    "cpu only": {"resources": {"gpu": 0, "cpu": 2, "memory": "4Gi"}},
    "two gpus": {"resources": {"gpu": 2}},
    "batching": {
        "batching": {
            "mode": "naive",
            "buckets": [32, 64],
            "maxBatchSize": 16,
            "maxTokensPerBatch": 4096,
            "maxWaitMs": 5,
        }
    },
    "admission explicit": {
        "admission": {
            "strategies": ["latency"],
            "maxDrainMs": 900,
            "p95SoftMs": 700,
            "p95HardMs": 1200,
            "latencyWindowSeconds": 5,
            "maxQueuedTokens": 100000,
        }
    },
    "no admission": {"admission": {"strategies": []}},
    "long inputs": {"longInputs": {"chunk": True, "maxChunks": 8}},
    "slo": {"slo": {"p95LatencyMs": 250}},
    "hpa": {"maxReplicas": 6, "autoscaling": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}},
    "hpa explicit targets": {
        "maxReplicas": 3,
        "autoscaling": {"targets": {"demandRatio": 0.9, "queueDrainSeconds": 0.2, "latencyP95Seconds": 0.3}},
    },
    "keda": {
        "minReplicas": 2,
        "maxReplicas": 8,
        "autoscaling": {"provider": "keda", "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0}}},
    },
    "autoscaling off": {"minReplicas": 3, "maxReplicas": 6, "autoscaling": {"enabled": False}},
    "headless": {"service": {"type": "Headless", "annotations": {"team": "search"}}},
    "scheduling": {
        "nodeSelector": {"gpu": "a100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "emb"}},
                        },
                    }
                ]
            }
        },
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "KEMBED_LOG_LEVEL", "value": "DEBUG"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ],
    },
    "compile cache on a PVC": {"compileCache": {"claimName": "compile-cache"}},
    "compile cache off": {"compileCache": {"enabled": False}},
    "image": {"image": "mine/kembed:2", "imagePullPolicy": "Always", "startupTimeoutSeconds": 1800},
    "tracing": {"tracing": {"otlpEndpoint": COLLECTOR, "serviceName": "search-embeddings", "sampleRatio": 0.1}},
}


def children(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {child.manifest["kind"]: child.manifest for child in render.render(OWNER, parse_spec(spec), CONFIG)}


def container(spec: dict[str, Any]) -> dict[str, Any]:
    return dict(children(spec)["Deployment"]["spec"]["template"]["spec"]["containers"][0])


def env(spec: dict[str, Any], config: OperatorConfig = CONFIG) -> dict[str, str]:
    (deployment,) = [c.manifest for c in render.render(OWNER, parse_spec(spec), config) if c.kind == kinds.DEPLOYMENT]
    variables = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in variables]
    assert len(names) == len(set(names)), names  # a name twice: server-side apply refuses the list
    return {e["name"]: e.get("value", "") for e in variables if "valueFrom" not in e}


@pytest.mark.parametrize("spec", FEATURES.values(), ids=FEATURES.keys())
def test_every_manifest_is_valid_kubernetes(spec: dict[str, Any]) -> None:
    for child in render.render(OWNER, parse_spec(spec), CONFIG):
        manifest = child.manifest
        if manifest["kind"] != "ScaledObject":  # a KEDA CRD: no built-in schema (checked below)
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
        (ref,) = manifest["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": kinds.EMBEDDING_SERVICE.api_version,
            "kind": identity.KIND,
            "name": "emb",
            "uid": "0000-1111",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert manifest["metadata"]["labels"][identity.LABEL_MANAGED_BY] == identity.MANAGED_BY
        assert (manifest["metadata"]["name"], manifest["metadata"]["namespace"]) == ("emb", "search")


@pytest.mark.parametrize("spec", FEATURES.values(), ids=FEATURES.keys())
def test_rendered_env_is_accepted_by_the_server(spec: dict[str, Any]) -> None:
    settings = Settings.from_env({k: v for k, v in env(spec).items() if k.startswith("KEMBED_")})
    assert (settings.grpc_host, settings.http_host) == ("::", "::")  # both families
    assert (settings.grpc_port, settings.http_port) == (GRPC_PORT, HTTP_PORT)


@pytest.mark.parametrize("spec", FEATURES.values(), ids=FEATURES.keys())
def test_the_env_spells_the_settings_the_operator_plans_with(spec: dict[str, Any]) -> None:
    """The startup budget reads the typed settings; the server reads their rendering: the same values."""
    planned = render.server_config(parse_spec(spec), derive(parse_spec(spec))).settings
    assert Settings.from_env({k: v for k, v in env(spec).items() if k.startswith("KEMBED_")}) == planned


CONTROL_TOKENS: dict[str, list[str]] = {
    "a comma": [","],
    "a token, then a comma": ["[query]", ","],
    "a token holding a comma": ["a,b"],
    "spaces at the ends": [" [q] ", "a b"],
    "tokens that look like JSON": ['["x"]', "[]", '"'],
}


@pytest.mark.parametrize("tokens", CONTROL_TOKENS.values(), ids=CONTROL_TOKENS.keys())
def test_control_tokens_reach_the_server_as_the_spec_lists_them(tokens: list[str]) -> None:
    """spec -> the container's env -> the server's Settings: the same list, item for item."""
    served = Settings.from_env({k: v for k, v in env({"model": {"controlTokens": tokens}}).items()})
    assert served.control_tokens == tokens


def test_the_default_prompt_reaches_the_server() -> None:
    assert env({"model": {"defaultPromptName": "query"}})["KEMBED_DEFAULT_PROMPT_NAME"] == "query"
    assert "KEMBED_DEFAULT_PROMPT_NAME" not in env({})  # unset: the model folder's default


def test_deployment_defaults() -> None:
    deployment = children({})["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert server["image"] == CONFIG.default_image
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["readinessProbe"]["httpGet"]["path"] == READYZ_PATH
    assert server["livenessProbe"]["httpGet"]["path"] == LIVEZ_PATH
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == READYZ_PATH
    # derived from the planned shapes (tests/operator/test_startup.py)
    budget = render.startup_seconds(parse_spec({}), Settings.from_env(env({})))
    assert startup["periodSeconds"] * startup["failureThreshold"] >= budget
    assert server["lifecycle"]["preStop"]["sleep"]["seconds"] == render.PRESTOP_SLEEP_S
    assert pod["terminationGracePeriodSeconds"] > render.PRESTOP_SLEEP_S + 25  # preStop + drain fit
    assert env({})[env_name("drain_timeout_s")] == "25"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert server["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["automountServiceAccountToken"] is False
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": METRICS_PATH,
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert env({})[env_name("device")] == "cuda"
    assert set(children({})) == {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}  # no autoscaler


def test_model_sources() -> None:
    pvc = FEATURES["pvc model"]
    assert env(pvc)[env_name("model")] == "/models/bge"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(pvc)["volumeMounts"]
    volumes = children(pvc)["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in volumes
    assert (env(pvc)[env_name("pooling")], env(pvc)[env_name("dtype")]) == ("cls", "float16")

    hub = FEATURES["hub model, emptyDir cache"]
    assert env(hub)[env_name("model")] == "BAAI/bge-small-en-v1.5"
    assert env(hub)[env_name("model_revision")] == "main"
    assert env(hub)[env_name("model_cache_dir")] == render.CACHE_DIR
    hub_volumes = children(hub)["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}} in hub_volumes
    cached = children(FEATURES["hub model, PVC cache"])["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in cached
    assert env_name("model") not in env({})  # the bundled model

    tokens = env(FEATURES["control tokens"])
    assert (tokens[env_name("control_tokens")], tokens[env_name("max_input_tokens")]) == ('["[query]", "[doc]"]', "256")


def test_resources() -> None:
    cpu = container(FEATURES["cpu only"])
    assert cpu["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    assert env(FEATURES["cpu only"])[env_name("device")] == "cpu"
    assert "tolerations" not in children(FEATURES["cpu only"])["Deployment"]["spec"]["template"]["spec"]
    assert container(FEATURES["two gpus"])["resources"]["limits"]["nvidia.com/gpu"] == "2"


def kubelet_resolves(entry: dict[str, Any], resources: dict[str, Any]) -> str:
    """What the kubelet puts in a resourceFieldRef variable: the quantity over the divisor, rounded up."""
    ref = entry["valueFrom"]["resourceFieldRef"]
    group, name = ref["resource"].split(".")
    return str(math.ceil(parse_quantity(resources[group][name]) / parse_quantity(ref["divisor"])))


@pytest.mark.parametrize(("cpu", "millicores", "compile_threads"), [("4", 4000, 4), ("500m", 500, 1), (2.5, 2500, 2)])
def test_the_server_sizes_from_the_cpu_request(cpu: Any, millicores: int, compile_threads: int) -> None:
    """The request reaches the server through the Downward API (no CPU limit to read from the cgroup)."""
    server = container({"resources": {"gpu": 1, "cpu": cpu}})
    assert "cpu" not in server["resources"]["limits"]
    (entry,) = [e for e in server["env"] if e["name"] == render.CPU_REQUEST_VAR]
    assert entry["valueFrom"]["resourceFieldRef"]["containerName"] == server["name"]
    variables = {**env({"resources": {"cpu": cpu}}), entry["name"]: kubelet_resolves(entry, server["resources"])}
    settings = Settings.from_env({k: v for k, v in variables.items() if k.startswith("KEMBED_")})
    assert settings.cpu_request_millicores == millicores
    assert variables[render.COMPILE_THREADS_VAR] == str(compile_threads)


@pytest.mark.parametrize(("memory", "limit_bytes"), [("16Gi", 16 * 2**30), ("1500M", 1_500_000_000)])
def test_the_server_sizes_its_memory_budget_from_the_memory_limit(memory: str, limit_bytes: int) -> None:
    """The limit reaches the server through the Downward API, in bytes (KEMBED_MEMORY_LIMIT_BYTES)."""
    server = container({"resources": {"cpu": "4", "memory": memory}})
    (entry,) = [e for e in server["env"] if e["name"] == render.MEMORY_LIMIT_VAR]
    assert entry["valueFrom"]["resourceFieldRef"]["containerName"] == server["name"]
    variables = {**env({"resources": {"cpu": "4", "memory": memory}})}
    variables[entry["name"]] = kubelet_resolves(entry, server["resources"])
    settings = Settings.from_env({k: v for k, v in variables.items() if k.startswith("KEMBED_")})
    assert settings.memory_limit_bytes == limit_bytes


def test_compile_threads_are_bounded_and_env_may_set_them() -> None:
    assert env({"resources": {"cpu": 96}})[render.COMPILE_THREADS_VAR] == str(render.INDUCTOR_MAX_COMPILE_THREADS)
    mine = {"env": [{"name": render.COMPILE_THREADS_VAR, "value": "2"}]}
    assert [e for e in container(mine)["env"] if e["name"] == render.COMPILE_THREADS_VAR] == mine["env"]


def test_batching_and_admission_pass_through() -> None:
    batching = env(FEATURES["batching"])
    assert {
        k: batching[env_name(k)]
        for k in ("batching", "buckets", "max_batch_size", "max_tokens_per_batch", "max_wait_ms")
    } == {
        "batching": "naive",
        "buckets": "32,64",
        "max_batch_size": "16",
        "max_tokens_per_batch": "4096",
        "max_wait_ms": "5",
    }
    assert env_name("buckets") not in env({})  # unset: the server's default
    admission = env(FEATURES["admission explicit"])
    names = ("admission", "max_drain_ms", "p95_soft_ms", "p95_hard_ms", "latency_window_s", "max_queued_tokens")
    assert [admission[env_name(k)] for k in names] == ["latency", "900", "700", "1200", "5", "100000"]
    # An empty strategy list means "no admission"; the API server drops empty values, so none is sent.
    assert {"name": env_name("admission")} in container(FEATURES["no admission"])["env"]


def test_long_inputs_reach_the_server_and_unset_keep_its_defaults() -> None:
    chunked = env(FEATURES["long inputs"])
    assert (chunked[env_name("chunk_long_inputs")], chunked[env_name("max_chunks_per_input")]) == ("true", "8")
    assert env({"longInputs": {"chunk": False}})[env_name("chunk_long_inputs")] == "false"
    unset = env({})
    assert env_name("chunk_long_inputs") not in unset and env_name("max_chunks_per_input") not in unset


def test_slo_drives_admission_and_hpa() -> None:
    slo = env(FEATURES["slo"])
    assert [slo[env_name(k)] for k in ("max_drain_ms", "p95_soft_ms", "p95_hard_ms")] == ["250", "250", "500"]
    hpa = children({**FEATURES["slo"], "maxReplicas": 2})["HorizontalPodAutoscaler"]
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert targets == {
        Metric.DEMAND_RATIO: "700m",
        Metric.QUEUE_DRAIN_SECONDS: "100m",
        Metric.LATENCY_P95_SECONDS: "250m",
    }


def test_hpa() -> None:
    rendered = children(FEATURES["hpa"])
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "emb"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 6)
    assert hpa["behavior"] == FEATURES["hpa"]["autoscaling"]["behavior"]  # verbatim
    assert all(m["type"] == "Pods" and m["pods"]["target"]["type"] == "AverageValue" for m in hpa["metrics"])
    assert "replicas" not in rendered["Deployment"]["spec"]  # the HPA owns it
    (deployment,) = [c for c in render.render(OWNER, parse_spec(FEATURES["hpa"]), CONFIG) if c.kind == kinds.DEPLOYMENT]
    assert deployment.on_create == {"spec": {"replicas": 1}}  # ...after it starts at minReplicas
    explicit = children(FEATURES["hpa explicit targets"])["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert [m["pods"]["target"]["averageValue"] for m in explicit] == ["900m", "200m", "300m"]


def test_hpa_scales_on_demand_with_the_operators_behavior_unless_the_spec_sets_one() -> None:
    hpa = children({"maxReplicas": 6})["HorizontalPodAutoscaler"]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == Metric.DEMAND_RATIO  # the guards follow it
    up, down = hpa["behavior"]["scaleUp"], hpa["behavior"]["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0 and {"type": "Pods", "value": 4, "periodSeconds": 15} in up["policies"]
    assert down["stabilizationWindowSeconds"] == 120
    assert down["policies"] == [{"type": "Percent", "value": 50, "periodSeconds": 60}]
    hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] = 1  # each render has its own copy
    assert (
        children({"maxReplicas": 6})["HorizontalPodAutoscaler"]["spec"]["behavior"]["scaleDown"][
            "stabilizationWindowSeconds"
        ]
        == 120
    )


def test_keda() -> None:
    rendered = children(FEATURES["keda"])
    assert "HorizontalPodAutoscaler" not in rendered
    scaled = rendered["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"name": "emb"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 8)
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 0}
    }
    queries = {t["metadata"]["query"]: t["metadata"]["threshold"] for t in spec["triggers"]}
    assert queries == {
        f'sum({Metric.DEMAND_RATIO}{{namespace="search",pod=~"emb-[a-z0-9]+-[a-z0-9]+"}})': "0.7",
        f'sum({Metric.QUEUE_DRAIN_SECONDS}{{namespace="search",pod=~"emb-[a-z0-9]+-[a-z0-9]+"}})': "0.4",
        f'sum({Metric.LATENCY_P95_SECONDS}{{namespace="search",pod=~"emb-[a-z0-9]+-[a-z0-9]+"}})': "1",
    }
    assert {t["metadata"]["serverAddress"] for t in spec["triggers"]} == {"http://prom:9090"}
    assert "replicas" not in rendered["Deployment"]["spec"]


def test_autoscaling_off_fixes_the_replica_count() -> None:
    rendered = children(FEATURES["autoscaling off"])
    assert rendered["Deployment"]["spec"]["replicas"] == 3
    assert not {"HorizontalPodAutoscaler", "ScaledObject"} & set(rendered)


def test_service_shapes() -> None:
    plain = children({})["Service"]
    assert plain["spec"]["type"] == "ClusterIP" and "clusterIP" not in plain["spec"]
    ports = {p["name"]: (p["port"], p.get("appProtocol")) for p in plain["spec"]["ports"]}
    assert ports == {"grpc": (GRPC_PORT, "grpc"), "rest": (REST_PORT, "http"), "http": (HTTP_PORT, None)}
    headless = children(FEATURES["headless"])["Service"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["metadata"]["annotations"] == {"team": "search"}
    assert plain["spec"]["selector"] == children({})["Deployment"]["spec"]["selector"]["matchLabels"]


def test_pdb_never_blocks_a_drain() -> None:
    pdb = children({})["PodDisruptionBudget"]["spec"]
    assert (pdb["maxUnavailable"], pdb["unhealthyPodEvictionPolicy"]) == (1, "AlwaysAllow")


def test_scheduling_pass_through() -> None:
    spec = FEATURES["scheduling"]
    pod = children(spec)["Deployment"]["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert pod["spec"]["affinity"] == spec["affinity"]
    assert spec["tolerations"][0] in pod["spec"]["tolerations"]
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    container_env = pod["spec"]["containers"][0]["env"]
    assert all(e in container_env for e in spec["env"])


def test_image_and_timing() -> None:
    spec = FEATURES["image"]
    server = container(spec)
    assert (server["image"], server["imagePullPolicy"]) == ("mine/kembed:2", "Always")
    assert server["startupProbe"]["periodSeconds"] * server["startupProbe"]["failureThreshold"] >= 1800


GRACE: dict[str, tuple[dict[str, Any], int]] = {
    # spec: seconds a terminating pod may go on finishing accepted requests
    "default": ({}, 25),
    "terminationGraceSeconds": ({"terminationGraceSeconds": 60}, 60),
    "drainSeconds, its deprecated name": ({"drainSeconds": 40}, 40),
    "both: the new name wins": ({"terminationGraceSeconds": 60, "drainSeconds": 40}, 60),
    "both, the new one zero": ({"terminationGraceSeconds": 0, "drainSeconds": 40}, 0),
}


@pytest.mark.parametrize(("spec", "seconds"), GRACE.values(), ids=GRACE.keys())
def test_termination_grace(spec: dict[str, Any], seconds: int) -> None:
    grace = children(spec)["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == render.PRESTOP_SLEEP_S + seconds + render.GRACE_MARGIN_S
    assert env(spec)[env_name("drain_timeout_s")] == str(seconds)


def test_tracing_renders_the_sdks_variables_only_with_an_endpoint() -> None:
    assert not {name for name in env({}) if name.startswith("OTEL_")}
    assert not {name for name in env({"tracing": {"sampleRatio": 0.5}}) if name.startswith("OTEL_")}  # no endpoint
    variables = env(FEATURES["tracing"])
    assert {name: variables[name] for name in OTEL} == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR,
        "OTEL_SERVICE_NAME": "search-embeddings",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    }
    assert variables["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.namespace.name=search"
    defaults = env({"tracing": {"otlpEndpoint": COLLECTOR}})
    assert (defaults["OTEL_SERVICE_NAME"], defaults["OTEL_TRACES_SAMPLER_ARG"]) == ("emb", "1")  # the resource's name


def test_the_operators_endpoint_serves_resources_that_name_none() -> None:
    operators = OperatorConfig(otlp_endpoint="http://collector.ops:4318", trace_sample_ratio=0.25)
    variables = env({}, operators)
    assert variables["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.ops:4318"
    assert (variables["OTEL_SERVICE_NAME"], variables["OTEL_TRACES_SAMPLER_ARG"]) == ("emb", "0.25")
    own = env({"tracing": {"otlpEndpoint": COLLECTOR, "sampleRatio": 0}}, operators)
    assert (own["OTEL_EXPORTER_OTLP_ENDPOINT"], own["OTEL_TRACES_SAMPLER_ARG"]) == (COLLECTOR, "0")
    assert not OTEL & set(env({"tracing": {"enabled": False}}, operators))
    assert not OTEL & set(env({"tracing": {"enabled": False, "otlpEndpoint": COLLECTOR}}))


def test_env_keeps_what_it_sets_unless_spec_tracing_sets_it_too() -> None:
    """A resource that set OTEL_* in env before spec.tracing existed keeps its values under the operator's
    default (once, never twice); the same variable in env and spec.tracing is a contradiction."""
    operators = OperatorConfig(otlp_endpoint="http://collector.ops:4318")
    authored = [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": COLLECTOR},
        {"name": "OTEL_SERVICE_NAME", "value": "s"},
    ]
    variables = env({"env": authored}, operators)
    assert (variables["OTEL_EXPORTER_OTLP_ENDPOINT"], variables["OTEL_SERVICE_NAME"]) == (COLLECTOR, "s")
    assert variables["OTEL_TRACES_SAMPLER_ARG"] == "1"
    assert env({"tracing": {"otlpEndpoint": COLLECTOR}, "env": authored[1:]})["OTEL_SERVICE_NAME"] == "s"
    with pytest.raises(InvalidSpec, match=r"spec\.env\[1\]: OTEL_SERVICE_NAME .* spec\.tracing\.serviceName"):
        env({"tracing": {"serviceName": "t"}, "env": authored}, operators)
    sampler = [{"name": "OTEL_TRACES_SAMPLER", "value": "always_on"}]
    with pytest.raises(InvalidSpec, match=r"spec\.tracing\.sampleRatio"):
        env({"tracing": {"otlpEndpoint": COLLECTOR, "sampleRatio": 0.5}, "env": sampler})


def test_render_is_deterministic() -> None:
    spec = parse_spec(FEATURES["scheduling"])
    assert render.render(OWNER, spec, CONFIG) == render.render(OWNER, spec, CONFIG)


# Fields no spec may set out of bounds, as the field, how a spec sets it, values refused (quantities
# Python parses but Kubernetes would not, on which the reconcile crashed; paths out of their volume;
# hub ids the server would load as a folder; absurd replica counts) and values accepted.
BOUNDED: dict[str, tuple[Callable[[Any], dict[str, Any]], list[Any], list[Any]]] = {
    "spec.resources.cpu": (
        lambda cpu: {"resources": {"cpu": cpu}},
        ["Infinity", "NaN", "inf", "1_000", " 1", "-1", "1e3m", float("inf"), True],
        ["500m", "1.5", "+2", ".5", "1e3", "2k", 4],
    ),
    "spec.resources.memory": (lambda memory: {"resources": {"memory": memory}}, ["Infinity", "16 Gi"], ["16Gi", "1e9"]),
    "spec.model.pvc.path": (
        lambda path: {"model": {"pvc": {"claimName": "m", "path": path}}},
        ["../../etc", "a/../../b", "/etc", ".", "a//b", "a/"],
        ["", "bge", "org/bge-v1.5", "..a/.b"],
    ),
    "spec.model.hub.id": (
        lambda hub: {"model": {"hub": {"id": hub}}},
        ["../x", "./models", "/models", "a/b/c", "a/../b", "a--b", "a..b", "x" * 97],
        ["BAAI/bge-small-en-v1.5", "all-MiniLM-L6-v2", "Alibaba-NLP/gte-large-en-v1.5", "org_x/y_z"],
    ),
    "spec.model.hub.revision": (
        lambda revision: {"model": {"hub": {"id": "a/b", "revision": revision}}},
        ["../../../tmp/x", "/abs", "refs/../../x"],
        ["main", "refs/pr/1", "v1.0", "0" * 40],
    ),
    "spec.model.defaultPromptName": (
        lambda name: {"model": {"defaultPromptName": name}},
        ["", "a b", "-query", "x" * 64, "é"],
        ["query", "s2p_query", "v1.0", "x" * 63],
    ),
    "spec.tracing.otlpEndpoint": (
        lambda url: {"tracing": {"otlpEndpoint": url}},
        [
            "otel-collector:4318",
            "grpc://otel-collector:4317",
            "http://",
            "http://:4318",
            "http://collector:4318/?tenant=a",
            "http://collector:4318#x",
            "http://collector:4318/a b",
            "",
            "http://x/" + "a" * 2048,
        ],
        [COLLECTOR, "https://otlp.example.com/otlp", "http://10.0.0.5:4318", "http://[fd00::5]:4318/"],
    ),
    "spec.tracing.sampleRatio": (lambda ratio: {"tracing": {"sampleRatio": ratio}}, [-0.1, 1.5], [0, 0.001, 1]),
    "spec.tracing.serviceName": (lambda name: {"tracing": {"serviceName": name}}, ["", "x" * 257], ["emb", "x" * 256]),
    "spec.minReplicas": (lambda count: {"minReplicas": count}, [100_000], [1, 100]),
    "spec.maxReplicas": (lambda count: {"maxReplicas": count}, [2_000_000_000, 10_001], [2, 10_000]),
}


def bounded(accepted: bool) -> dict[str, tuple[dict[str, Any], str]]:
    """Specs from BOUNDED: id -> (spec, the field)."""
    return {
        f"{field} {value!r}": (build(value), field)
        for field, (build, refused, fine) in BOUNDED.items()
        for value in (fine if accepted else refused)
    }


@pytest.mark.parametrize("spec", [spec for spec, _ in bounded(True).values()], ids=bounded(True).keys())
def test_bounded_fields_take_what_kubernetes_and_the_server_take(spec: dict[str, Any]) -> None:
    for child in render.render(OWNER, parse_spec(spec), CONFIG):
        kubernetes_validate.validate(child.manifest, K8S_VERSION, strict=True)


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "derived hard below explicit soft": ({"admission": {"p95SoftMs": 5000}}, "KEMBED_P95_SOFT_MS"),
    "explicit soft above hard": ({"admission": {"p95SoftMs": 900, "p95HardMs": 800}}, "KEMBED_P95_SOFT_MS"),
    "max below min": ({"minReplicas": 3, "maxReplicas": 2}, "maxReplicas"),
    "both model sources": ({"model": {"pvc": {"claimName": "a"}, "hub": {"id": "b"}}}, "not both"),
    "unknown field": ({"replicas": 3}, "spec.replicas"),
    "wrong type": ({"slo": {"p95LatencyMs": "fast"}}, "spec.slo.p95LatencyMs"),
    "unsorted buckets": ({"batching": {"buckets": [64, 32]}}, "KEMBED_BUCKETS"),
    "env fights the spec": ({"env": [{"name": "KEMBED_P95_SOFT_MS", "value": "1"}]}, "spec.env[0]"),
    "env typo": ({"env": [{"name": "KEMBED_MAX_BATCH", "value": "1"}]}, "not a kembed server setting"),
    "bad env value": ({"env": [{"name": "KEMBED_LATENCY_WINDOW_S", "value": "-1"}]}, "KEMBED_LATENCY_WINDOW_S"),
    "keda without prometheus": ({"maxReplicas": 2, "autoscaling": {"provider": "keda"}}, "kedaServerAddress"),
    "env fights the cpu request": (
        {"env": [{"name": "KEMBED_CPU_REQUEST_MILLICORES", "value": "64000"}]},
        "spec.env[0]: KEMBED_CPU_REQUEST_MILLICORES is rendered",
    ),
    "cpu not a quantity": ({"resources": {"cpu": "lots"}}, "spec.resources.cpu"),
    "env fights spec.tracing": (
        {"tracing": {"otlpEndpoint": COLLECTOR}, "env": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": COLLECTOR}]},
        "spec.env[0]: OTEL_EXPORTER_OTLP_ENDPOINT is rendered by the operator from spec.tracing.otlpEndpoint",
    ),
    "empty control token": ({"model": {"controlTokens": ["[q]", ""]}}, "spec.model.controlTokens.1"),
    **bounded(False),
    "negative deprecated grace": ({"drainSeconds": -1}, "spec.drainSeconds"),
}


@pytest.mark.parametrize(("spec", "needle"), INVALID.values(), ids=INVALID.keys())
def test_invalid_specs_are_explained(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidSpec, match=needle.replace("[", r"\[").replace(".", r"\.")):
        render.render(OWNER, parse_spec(spec), OperatorConfig())


def test_the_rest_endpoint_is_the_openai_base_url() -> None:
    owner = render.Owner("bge", "search", "uid")
    assert render.rest_endpoint(owner, tls=False) == f"http://bge.search.svc.cluster.local:{REST_PORT}/v1"
    assert render.rest_endpoint(owner, tls=True).startswith("https://")
