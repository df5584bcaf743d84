"""Spec in, manifests out (pure: no I/O, no clock).

Every child is named after its EmbeddingService, labelled so the operator can watch it, and owned
through a controller ownerReference so Kubernetes deletes it with its owner. The server's ports,
probe paths, metric names and variable names come from :mod:`kembed.contract`; the variables the
operator renders come from one value of the server's own :class:`kembed.config.settings.Settings`, built from
the spec, so a spec the server would refuse to start with is rejected here, as a condition, instead
of as a crash loop.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.contract import (
    ANY_ADDRESS,
    ENV_PREFIX,
    GRPC_PORT,
    HTTP_PORT,
    LIVEZ_PATH,
    METRICS_PATH,
    READYZ_PATH,
    REST_PORT,
    Metric,
    env_name,
)
from kembed_operator import access, identity, kinds, startup
from kembed_operator.config import OperatorConfig
from kembed_operator.kinds import Manifest
from kembed_operator.slo import Thresholds, derive
from kembed_operator.spec import EmbeddingServiceSpec, EnvVar, InvalidSpec

RUN_AS = 10001  # the uid/gid Dockerfile.server creates
PRESTOP_SLEEP_S = 5  # lets endpoint removal reach every client before the server stops accepting
GRACE_MARGIN_S = 5
STARTUP_PERIOD_S = 10
MODEL_DIR = "/models"
CACHE_DIR = "/cache"
COMPILE_CACHE_DIR = "/compile-cache"
GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "server"
# The server sizes its front ends from the CPU request (no CPU limit: see _resources), in millicores,
# and their memory budgets from the memory limit, in bytes.
CPU_REQUEST_VAR = env_name("cpu_request_millicores")
MEMORY_LIMIT_VAR = env_name("memory_limit_bytes")
# inductor's compile workers; unset, it starts one per core of the node (up to its own cap of 32).
COMPILE_THREADS_VAR = "TORCHINDUCTOR_COMPILE_THREADS"
INDUCTOR_MAX_COMPILE_THREADS = 32
# OpenTelemetry's own variables, which the server's SDK reads (kembed.frontend.tracing).
OTLP_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_ENDPOINT"
SERVICE_NAME_VAR = "OTEL_SERVICE_NAME"
SAMPLER_VAR = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG_VAR = "OTEL_TRACES_SAMPLER_ARG"
RESOURCE_ATTRIBUTES_VAR = "OTEL_RESOURCE_ATTRIBUTES"
# A caller's sampled (or unsampled) traceparent is followed; a trace that starts here is kept at the ratio.
SAMPLER = "parentbased_traceidratio"


# Settings only the operator sets, whatever the spec: where the model, its caches and the
# certificates are (an author's path there could point into a claim they write), and the pod's own
# addresses and size.
OPERATOR_SETTINGS = frozenset(
    {
        "model",
        "model_revision",
        "model_cache_dir",
        "compile_cache_dir",
        "tls_cert_file",
        "tls_key_file",
        "tls_client_ca_file",
        "api_key_file",
        "grpc_host",
        "grpc_port",
        "http_host",
        "http_port",
        "rest_port",
        "device",
        "cpu_request_millicores",
        "memory_limit_bytes",
    }
)


@dataclass(frozen=True)
class Owner:
    """The resource the children belong to."""

    name: str
    namespace: str
    uid: str
    kind: kinds.Kind = kinds.EMBEDDING_SERVICE


@dataclass(frozen=True)
class Desired:
    """A child as the spec wants it: ``manifest`` is applied on every reconcile, ``on_create`` merged in
    only when creating (the initial replica count, which an autoscaler owns afterwards)."""

    manifest: Manifest
    on_create: Manifest = field(default_factory=dict)

    @property
    def kind(self) -> kinds.Kind:
        return kinds.of(self.manifest)


def render(owner: Owner, spec: EmbeddingServiceSpec, config: OperatorConfig) -> list[Desired]:
    """The children ``spec`` needs, or :class:`InvalidSpec` when they would not work."""
    thresholds = derive(spec)
    server = server_config(spec, thresholds)
    children = [
        _deployment(owner, spec, config, server),
        Desired(_service(owner, spec)),
        Desired(_pdb(owner)),
    ]
    if spec.network_policy.enabled:
        policy = access.network_policy_spec(selector_labels(owner.name), spec, config)
        children.append(Desired(_object(kinds.NETWORK_POLICY, owner, policy)))
    if spec.autoscaled and spec.autoscaling.provider == "hpa":
        children.append(Desired(_hpa(owner, spec, thresholds)))
    elif spec.autoscaled:
        children.append(Desired(_scaled_object(owner, spec, thresholds, config)))
    return children


# --- identity -------------------------------------------------------------------------------------


def selector_labels(name: str) -> dict[str, str]:
    return {identity.LABEL_NAME: identity.APP_NAME, identity.LABEL_INSTANCE: name}


def selector(name: str) -> str:
    """The label selector in string form, as the scale subresource wants it."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        identity.LABEL_COMPONENT: "embedding-server",
        identity.LABEL_MANAGED_BY: identity.MANAGED_BY,
    }


def grpc_address(name: str, namespace: str) -> str:
    """The Service's gRPC HOST:PORT in the cluster, the name its TLS certificate must carry."""
    return f"{name}.{namespace}.svc.cluster.local:{GRPC_PORT}"


def endpoint(owner: Owner) -> str:
    """Where gRPC clients dial."""
    return f"dns:///{grpc_address(owner.name, owner.namespace)}"


def rest_endpoint(owner: Owner, tls: bool) -> str:
    """The OpenAI API's base URL (what the official client calls ``base_url``)."""
    return f"{'https' if tls else 'http'}://{owner.name}.{owner.namespace}.svc.cluster.local:{REST_PORT}/v1"


def model_name(spec: EmbeddingServiceSpec) -> str:
    """What the status and the printer column show as the model."""
    model = spec.model
    if model.hub is not None:
        return model.hub.id
    if model.pvc is not None:
        return f"pvc:{model.pvc.claim_name}/{model.pvc.path}".rstrip("/")
    return "bundled:all-MiniLM-L6-v2"


def _object(kind: kinds.Kind, owner: Owner, spec: Manifest, **metadata: Any) -> Manifest:
    return {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": owned_metadata(owner, labels(owner.name), **metadata),
        "spec": spec,
    }


def owned_metadata(owner: Owner, object_labels: dict[str, str], **extra: Any) -> Manifest:
    """A child's metadata: named after its owner, which controls it (and whose deletion takes it)."""
    reference = {
        "apiVersion": owner.kind.api_version,
        "kind": owner.kind.kind,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": object_labels,
        "ownerReferences": [reference],
        **extra,
    }


# --- server environment ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    """What the server will start with: its ``settings`` (``spec.env``'s literal values included), for
    whatever needs a typed value, and ``env``, the ``KEMBED_*`` variables the spec decides, rendered
    from those settings."""

    settings: Settings
    env: dict[str, str]


def server_config(spec: EmbeddingServiceSpec, thresholds: Thresholds) -> ServerConfig:
    """The server's settings, built once; :class:`InvalidSpec` when the server would refuse them at
    start-up, or when ``spec.env`` fights the spec."""
    decided = _decided_settings(spec, thresholds)
    try:
        settings = Settings.from_env(_literal_env(spec.env, decided), **decided)
    except ConfigError as err:
        raise InvalidSpec(f"server settings: {err}") from None
    return ServerConfig(settings, {env_name(name): _text(getattr(settings, name)) for name in decided})


def _decided_settings(spec: EmbeddingServiceSpec, thresholds: Thresholds) -> dict[str, Any]:
    """The server settings the spec decides (field name -> value); the rest keep the server's defaults."""
    model, batching, admission = spec.model, spec.batching, spec.admission
    settings: dict[str, Any] = {
        # The server binds loopback by default; in a pod it must listen on the pod's addresses, of
        # either family: IPv4, IPv6 or dual-stack clusters (IPv4 alone where the node has no IPv6).
        "grpc_host": ANY_ADDRESS,
        "http_host": ANY_ADDRESS,
        "grpc_port": GRPC_PORT,
        "http_port": HTTP_PORT,
        "rest_port": REST_PORT,
        "served_model_name": model.served_name,
        "default_prompt_name": model.default_prompt_name,
        "device": device_type(spec),
        "pooling": model.pooling,
        "control_tokens": model.control_tokens,
        "max_input_tokens": model.max_input_tokens,
        "dtype": model.dtype,
        "batching": batching.mode,
        "buckets": batching.buckets,
        "max_batch_size": batching.max_batch_size,
        "max_tokens_per_batch": batching.max_tokens_per_batch,
        "max_wait_ms": batching.max_wait_ms,
        "admission": admission.strategies,
        "max_drain_ms": thresholds.max_drain_ms,
        "p95_soft_ms": thresholds.p95_soft_ms,
        "p95_hard_ms": thresholds.p95_hard_ms,
        "latency_window_s": admission.latency_window_seconds,
        "max_queued_tokens": admission.max_queued_tokens,
        "chunk_long_inputs": spec.long_inputs.chunk,
        "max_chunks_per_input": spec.long_inputs.max_chunks,
        "drain_timeout_s": spec.grace_seconds,
        "compile_cache_dir": COMPILE_CACHE_DIR if spec.compile_cache.enabled else None,
        **_model_source(spec),
        **access.tls_settings(spec),
    }
    return {name: value for name, value in settings.items() if value is not None}


def _literal_env(extra: list[EnvVar], decided: dict[str, Any]) -> dict[str, str]:
    """``spec.env``'s literal ``KEMBED_*`` values, which change what the server starts with; refuses
    variables the operator sets and names that are no server setting."""
    operators = {env_name(name) for name in OPERATOR_SETTINGS.union(decided)}
    literal = {}
    for index, var in enumerate(extra):
        if not var.name.startswith(ENV_PREFIX):
            continue
        if var.name in operators:
            raise InvalidSpec(f"spec.env[{index}]: {var.name} is rendered by the operator from the spec; set it there")
        if var.name[len(ENV_PREFIX) :].lower() not in Settings.model_fields:
            raise InvalidSpec(f"spec.env[{index}]: {var.name} is not a kembed server setting")
        if var.value is not None:
            literal[var.name] = var.value
    return literal


def device_type(spec: EmbeddingServiceSpec) -> str:
    return "cuda" if spec.resources.gpu else "cpu"


def _model_source(spec: EmbeddingServiceSpec) -> dict[str, str]:
    pvc, hub = spec.model.pvc, spec.model.hub
    if pvc is not None:
        return {"model": f"{MODEL_DIR}/{pvc.path}".rstrip("/")}
    if hub is not None:
        return {"model": hub.id, "model_revision": hub.revision, "model_cache_dir": CACHE_DIR}
    return {}


def _text(value: Any) -> str:
    """A value as an environment variable or a manifest string spells it: lists of free text (control
    tokens, which may hold commas or spaces) as a JSON list, other lists comma-separated, enums by
    value, booleans as true or false, whole floats without a fraction."""
    if isinstance(value, list) and any(isinstance(item, str) and not isinstance(item, Enum) for item in value):
        return json.dumps(value)
    if isinstance(value, list):
        return ",".join(_text(item) for item in value)
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def tracing_env(owner: Owner, spec: EmbeddingServiceSpec, config: OperatorConfig) -> list[Manifest]:
    """OpenTelemetry's variables when ``spec.tracing``, or else the operator, names an OTLP endpoint:
    the endpoint, the service name (default: the resource's), the sampler at the spec's ratio or the
    operator's, and the namespace as a resource attribute. A variable ``spec.env`` sets is left to it,
    unless a ``spec.tracing`` field sets it too: :class:`InvalidSpec`."""
    tracing = spec.tracing
    endpoint = tracing.otlp_endpoint or config.otlp_endpoint
    if not tracing.enabled or not endpoint:
        return []
    ratio = config.trace_sample_ratio if tracing.sample_ratio is None else tracing.sample_ratio
    # name -> (value, the spec.tracing field that decides it, if one does)
    sampled = "sampleRatio" if tracing.sample_ratio is not None else None
    rendered: dict[str, tuple[str, str | None]] = {
        OTLP_ENDPOINT_VAR: (endpoint, "otlpEndpoint" if tracing.otlp_endpoint else None),
        SERVICE_NAME_VAR: (tracing.service_name or owner.name, "serviceName" if tracing.service_name else None),
        SAMPLER_VAR: (SAMPLER, sampled),
        SAMPLER_ARG_VAR: (_text(ratio), sampled),
        RESOURCE_ATTRIBUTES_VAR: (f"k8s.namespace.name={owner.namespace}", None),
    }
    authored = {var.name: index for index, var in enumerate(spec.env)}
    entries: list[Manifest] = []
    for name, (value, field_name) in rendered.items():
        if name not in authored:
            entries.append({"name": name, "value": value})
        elif field_name is not None:
            raise InvalidSpec(
                f"spec.env[{authored[name]}]: {name} is rendered by the operator from spec.tracing.{field_name}; "
                "set it in one place"
            )
    return entries


def sizing_env(spec: EmbeddingServiceSpec) -> list[Manifest]:
    """Size from the pod, not the node: the CPU request and the memory limit, passed down by the
    kubelet (Downward API), and inductor's compile workers bounded by the CPUs (each is a process with
    memory of its own), unless ``spec.env`` sets them."""
    request = {"containerName": CONTAINER, "resource": "requests.cpu", "divisor": "1m"}
    memory = {"containerName": CONTAINER, "resource": "limits.memory", "divisor": "1"}
    entries: list[Manifest] = [
        {"name": CPU_REQUEST_VAR, "valueFrom": {"resourceFieldRef": request}},
        {"name": MEMORY_LIMIT_VAR, "valueFrom": {"resourceFieldRef": memory}},
    ]
    if not any(var.name == COMPILE_THREADS_VAR for var in spec.env):
        entries.append({"name": COMPILE_THREADS_VAR, "value": str(compile_threads(spec.resources.cpu))})
    return entries


def compile_threads(cpu: str) -> int:
    """One compile worker per whole requested CPU, at least one, at most inductor's own cap; ``cpu`` is a
    quantity the spec checked (no "Infinity" or "NaN", which Python's parser would take)."""
    return max(1, min(INDUCTOR_MAX_COMPILE_THREADS, math.floor(parse_quantity(cpu))))


# --- Deployment -----------------------------------------------------------------------------------


def _deployment(owner: Owner, spec: EmbeddingServiceSpec, config: OperatorConfig, server: ServerConfig) -> Desired:
    deployment_spec: Manifest = {
        "selector": {"matchLabels": selector_labels(owner.name)},
        # Never fewer ready pods than wanted during a rollout: warmup is slow and capacity is scarce.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {"labels": labels(owner.name), "annotations": _pod_annotations(spec)},
            "spec": _pod_spec(owner, spec, config, server),
        },
    }
    manifest = _object(kinds.DEPLOYMENT, owner, deployment_spec)
    if spec.autoscaled:  # the autoscaler owns the count: set it once, at creation, never again
        return Desired(manifest, on_create={"spec": {"replicas": spec.min_replicas}})
    deployment_spec["replicas"] = spec.min_replicas
    return Desired(manifest)


def _pod_annotations(spec: EmbeddingServiceSpec) -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": METRICS_PATH,
        **spec.pod_annotations,
    }


def _pod_spec(owner: Owner, spec: EmbeddingServiceSpec, config: OperatorConfig, server: ServerConfig) -> Manifest:
    volumes, mounts = _volumes(spec)
    pod: Manifest = {
        "automountServiceAccountToken": False,  # the server never calls the API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_S + spec.grace_seconds + GRACE_MARGIN_S,
        "securityContext": pod_security(),
        "containers": [_container(owner, spec, config, server, mounts)],
        "volumes": volumes,
    }
    tolerations = _tolerations(spec)
    optional = {"nodeSelector": spec.node_selector, "tolerations": tolerations, "affinity": spec.affinity}
    pod.update({key: value for key, value in optional.items() if value})
    return pod


def _container(
    owner: Owner,
    spec: EmbeddingServiceSpec,
    config: OperatorConfig,
    server: ServerConfig,
    mounts: list[Manifest],
) -> Manifest:
    startup_failures = math.ceil(startup_seconds(spec, server.settings) / STARTUP_PERIOD_S)
    return {
        "name": CONTAINER,
        "image": server_image(spec, config),
        "imagePullPolicy": spec.image_pull_policy,
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "rest", "containerPort": REST_PORT, "protocol": "TCP"},
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
        ],
        "env": [
            # The API server drops `value: ""`, so an empty value is spelt as no value: no false drift.
            *({"name": name, "value": value} if value else {"name": name} for name, value in server.env.items()),
            *access.api_key_env(spec),
            *sizing_env(spec),
            *tracing_env(owner, spec, config),
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            *(var.manifest() for var in spec.env),
        ],
        "resources": _resources(spec),
        # Startup waits for /readyz: model load, warmup and CUDA graph capture can take minutes.
        "startupProbe": _probe(READYZ_PATH, period=STARTUP_PERIOD_S, failures=startup_failures),
        "readinessProbe": _probe(READYZ_PATH, period=5, failures=2),
        "livenessProbe": _probe(LIVEZ_PATH, period=10, failures=3),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }


def server_image(spec: EmbeddingServiceSpec, config: OperatorConfig) -> str:
    return spec.image or config.default_image


def pod_security() -> Manifest:
    """Non-root as the image's user, RuntimeDefault seccomp: every pod the operator makes."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Manifest:
    """No privilege escalation, no capabilities, a read-only root filesystem: every container it makes."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _probe(path: str, *, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _resources(spec: EmbeddingServiceSpec) -> Manifest:
    res = spec.resources
    requests = {"cpu": res.cpu, "memory": res.memory}
    # No CPU limit: CFS throttling stalls every thread of the pod for the rest of a 100 ms period once
    # the quota is spent, however idle the node (docs/operator.md). The server sizes from the request.
    limits = {"memory": res.memory}
    if res.gpu:
        limits[GPU_RESOURCE] = str(res.gpu)
    return {"requests": requests, "limits": limits}


def _tolerations(spec: EmbeddingServiceSpec) -> list[Manifest]:
    tolerations = [toleration.manifest() for toleration in spec.tolerations]
    # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule; a GPU pod may always go there.
    if spec.resources.gpu and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _volumes(spec: EmbeddingServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [{"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}}]
    mounts: list[Manifest] = [{"name": "tmp", "mountPath": "/tmp"}]
    pvc, hub = spec.model.pvc, spec.model.hub
    if pvc is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    if hub is not None:
        volumes.append({"name": "model-cache", **_claim_or_empty_dir(hub.cache_claim_name, hub.cache_size_limit)})
        mounts.append({"name": "model-cache", "mountPath": CACHE_DIR})
    cache_volumes, cache_mounts = _compile_cache(spec)
    tls_volumes, tls_mounts = access.tls_volumes(spec)
    key_volumes, key_mounts = access.api_key_volumes(spec)
    return volumes + cache_volumes + tls_volumes + key_volumes, mounts + cache_mounts + tls_mounts + key_mounts


def _compile_cache(spec: EmbeddingServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    cache = spec.compile_cache
    if not cache.enabled:
        return [], []
    source = _claim_or_empty_dir(cache.claim_name, cache.size_limit)
    return [{"name": "compile-cache", **source}], [{"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR}]


def _claim_or_empty_dir(claim_name: str, size_limit: str) -> Manifest:
    """A volume source: the named PVC, or without one an emptyDir, which lives as long as the pod."""
    if claim_name:
        return {"persistentVolumeClaim": {"claimName": claim_name}}
    return {"emptyDir": {"sizeLimit": size_limit}}


def startup_seconds(spec: EmbeddingServiceSpec, settings: Settings) -> int:
    """The spec's startup timeout, or one derived from how the server will warm up: its graph mode
    and shapes, from the settings it will start with."""
    if spec.startup_timeout_seconds is not None:
        return spec.startup_timeout_seconds
    return startup.startup_budget_seconds(settings, device_type(spec))


# --- Service, PDB ---------------------------------------------------------------------------------


def _service(owner: Owner, spec: EmbeddingServiceSpec) -> Manifest:
    service_spec: Manifest = {
        "type": "ClusterIP",
        "selector": selector_labels(owner.name),
        "ports": [
            {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
            {"name": "rest", "port": REST_PORT, "targetPort": "rest", "protocol": "TCP", "appProtocol": "http"},
            {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
        ],
    }
    if spec.service.type == "Headless":
        service_spec["clusterIP"] = "None"
    annotations = {"annotations": spec.service.annotations} if spec.service.annotations else {}
    return _object(kinds.SERVICE, owner, service_spec, **annotations)


def _pdb(owner: Owner) -> Manifest:
    pdb_spec = {
        "selector": {"matchLabels": selector_labels(owner.name)},
        # One voluntary disruption at a time; never blocks a node drain for good, even at 1 replica
        # or while pods crash-loop.
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    return _object(kinds.PDB, owner, pdb_spec)


# --- autoscaling ----------------------------------------------------------------------------------


# The HPA's behavior unless the spec sets one. Up: the API's default (at once, doubling or 4 pods
# per 15 s): the demand does not saturate, so one sync proposes the size the load needs. Down: the
# demand is an average over 15 s, not a noisy instant, and sums to the fleet's offered load, so the
# proposal is a fixed point (no feedback from pod count to the metric, unlike the drain time); 120 s
# rides out a pause in traffic shorter than a pod start, and half the pods a minute at most leaves
# the rest time to show the load they take over before the next step down.
BEHAVIOR: Manifest = {
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "selectPolicy": "Max",
        "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 15},
            {"type": "Pods", "value": 4, "periodSeconds": 15},
        ],
    },
    "scaleDown": {
        "stabilizationWindowSeconds": 120,
        "selectPolicy": "Max",
        "policies": [{"type": "Percent", "value": 50, "periodSeconds": 60}],
    },
}


def targets(thresholds: Thresholds) -> dict[str, float]:
    """Metric name -> per-pod target, the numbers both autoscaler kinds aim for: the demand, then
    the guards (seconds), each proposing a size and the largest winning."""
    return {
        Metric.DEMAND_RATIO: thresholds.target_demand_ratio,
        Metric.QUEUE_DRAIN_SECONDS: thresholds.target_queue_drain_s,
        Metric.LATENCY_P95_SECONDS: thresholds.target_latency_p95_s,
    }


def quantity(value: float) -> str:
    """A value (seconds, a ratio) as a Kubernetes quantity in milli-units: 0.5 -> "500m"."""
    return f"{round(value * 1000)}m"


def _hpa(owner: Owner, spec: EmbeddingServiceSpec, thresholds: Thresholds) -> Manifest:
    metrics = [
        {
            "type": "Pods",
            "pods": {"metric": {"name": name}, "target": {"type": "AverageValue", "averageValue": quantity(target)}},
        }
        for name, target in targets(thresholds).items()
    ]
    hpa_spec: Manifest = {
        "scaleTargetRef": {
            "apiVersion": kinds.DEPLOYMENT.api_version,
            "kind": kinds.DEPLOYMENT.kind,
            "name": owner.name,
        },
        "minReplicas": spec.min_replicas,
        "maxReplicas": spec.replica_ceiling,
        "metrics": metrics,
        "behavior": _behavior(spec),
    }
    return _object(kinds.HPA, owner, hpa_spec)


def _behavior(spec: EmbeddingServiceSpec) -> Manifest:
    return copy.deepcopy(BEHAVIOR) if spec.autoscaling.behavior is None else spec.autoscaling.behavior


def pod_matcher(owner: Owner) -> str:
    """PromQL label matchers for the pods of one Deployment (NAME-<template hash>-<suffix>)."""
    return f'namespace="{owner.namespace}",pod=~"{owner.name}-[a-z0-9]+-[a-z0-9]+"'


def _scaled_object(
    owner: Owner, spec: EmbeddingServiceSpec, thresholds: Thresholds, config: OperatorConfig
) -> Manifest:
    keda = spec.autoscaling.keda
    # The administrator's Prometheus, never the author's: KEDA fetches it from its own namespace.
    address = config.keda_server_address
    if not address:
        raise InvalidSpec(
            "spec.autoscaling.provider: keda needs the Prometheus its administrator names (kedaServerAddress), "
            "and the operator has none"
        )
    # KEDA's AverageValue divides the query by the replica count, so summing over pods gives the
    # same per-pod average an HPA Pods metric compares with its target.
    triggers = [
        {
            "type": "prometheus",
            "name": name.replace("_", "-"),
            "metadata": {
                "serverAddress": address,
                "query": f"sum({name}{{{pod_matcher(owner)}}})",
                "threshold": _text(target),
            },
        }
        for name, target in targets(thresholds).items()
    ]
    so_spec: Manifest = {
        "scaleTargetRef": {"name": owner.name},
        "minReplicaCount": spec.min_replicas,
        "maxReplicaCount": spec.replica_ceiling,
        "pollingInterval": keda.polling_interval,
        "cooldownPeriod": keda.cooldown_period,
        "triggers": triggers,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
    }
    return _object(kinds.SCALED_OBJECT, owner, so_spec)
