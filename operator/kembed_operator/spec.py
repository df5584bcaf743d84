"""The EmbeddingService spec as typed, checked values (pure), and the CRD's schema source.

These models are the one source of the CRD's ``spec`` schema: :mod:`kembed_operator.crd` generates
``crds/`` and the chart's copy from them (field names, types, bounds, defaults, descriptions and the
CEL rules in ``json_schema_extra``), so the schema and the operator cannot disagree. The schema is
the first line of defence; this module is the second: it rejects what a schema cannot express or
what got past it (an older CRD, a client that skipped validation), raising :class:`InvalidSpec`,
which the handlers turn into a condition instead of a crash. :data:`DEFAULT_GRACE_SECONDS` is the
one default only this module applies.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kembed.config.values import Admission, Batching, Dtype, Pooling
from kembed.domain.prompts import NAME_PATTERN as PROMPT_NAME_PATTERN


class InvalidSpec(ValueError):
    """The spec cannot be rendered; the message says which field and why, ``reason`` is the condition's."""

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(message)
        self.reason = reason


# The schema's bound on replicas; the operator's administrator sets the limit under it (maxReplicas).
REPLICAS_CEILING = 10_000

# terminationGraceSeconds when neither it nor drainSeconds is set. The resource's own default, not
# the CRD's: a schema default would be stored on every resource and so outrank a drainSeconds.
DEFAULT_GRACE_SECONDS = 25

# Kubernetes' quantity syntax (apimachinery's resource.Quantity, as controller-gen writes it for a
# schema) less the sign: a request or a size is never negative. Python's parsers take more
# ("Infinity", "NaN", "1_000", " 1"), which no pod could carry.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A path inside a volume (or a hub revision, which the hub's cache files by name): relative, no
# empty, "." or ".." part (a part may start with dots, "..a" say, and still stay inside).
_PART = r"([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+)"
RELATIVE_PATH_PATTERN = rf"^({_PART}(/{_PART})*)?$"
# NAME or OWNER/NAME, each of letters, digits and _ joined by single . or -: a subset of the hub's
# own rule that no path resolves out of (a hub id is also what the server would load as a folder).
_HUB_NAME = r"[A-Za-z0-9_]+([.-][A-Za-z0-9_]+)*"
HUB_ID_PATTERN = rf"^({_HUB_NAME}/)?{_HUB_NAME}$"
HUB_ID_MAX_LENGTH = 96  # the hub's own limit
# A Secret's data key (apimachinery's IsConfigMapKey).
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# An OTLP/HTTP collector's base URL: http(s), a host (and port), at most a path (the SDK appends
# /v1/traces); no query, fragment or space.
OTLP_ENDPOINT_PATTERN = r"^https?://[^/?#\s:][^/?#\s]*(/[^?#\s]*)?$"
OTLP_ENDPOINT_MAX_LENGTH = 2048


def matching(pattern: str, what: str) -> AfterValidator:
    """A check that a string matches ``pattern`` (the schema's, so both refuse alike), naming ``what`` it must be."""

    def check(value: str) -> str:
        if re.fullmatch(pattern, value) is None:
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


# The CRD accepts `cpu: 4` as well as `cpu: "4"` (int-or-string); manifests need the string.
Quantity = Annotated[
    str,
    BeforeValidator(lambda v: str(v) if isinstance(v, int | float) else v),
    matching(QUANTITY_PATTERN, "a Kubernetes quantity (e.g. 4, 500m, 16Gi)"),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]
RelativePath = Annotated[
    str,
    matching(RELATIVE_PATH_PATTERN, "a relative path inside the volume, without empty, '.' or '..' parts"),
    Field(json_schema_extra={"pattern": RELATIVE_PATH_PATTERN}),
]
HubId = Annotated[
    str,
    matching(HUB_ID_PATTERN, "a hub id: NAME or OWNER/NAME, of letters, digits and _ joined by single . or -"),
    Field(min_length=1, max_length=HUB_ID_MAX_LENGTH, json_schema_extra={"pattern": HUB_ID_PATTERN}),
]
OtlpEndpoint = Annotated[
    str,
    matching(OTLP_ENDPOINT_PATTERN, "an http(s) URL without a query or fragment (e.g. http://otel-collector:4318)"),
    Field(max_length=OTLP_ENDPOINT_MAX_LENGTH, json_schema_extra={"pattern": OTLP_ENDPOINT_PATTERN}),
]
# One of a model's prompts, by name (kembed.domain.prompts: the server's own rule for a name).
PromptName = Annotated[
    str,
    matching(PROMPT_NAME_PATTERN, "a prompt name: a letter or digit, then up to 62 letters, digits, _, . or -"),
    Field(json_schema_extra={"pattern": PROMPT_NAME_PATTERN}),
]
# A Kubernetes object passed through verbatim (the API server checks it when the child is applied).
Verbatim = dict[str, Any]


def cel(rule: str, message: str) -> dict[str, Any]:
    """A CRD validation rule (CEL) for ``json_schema_extra``; each has a Python twin in this package."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class SpecModel(BaseModel):
    """A part of a resource's spec: camelCase in the resource, unknown fields refused, immutable."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    def manifest(self) -> dict[str, Any]:
        """This part as the API's JSON (camelCase, unset fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class PvcSource(SpecModel):
    claim_name: str = Field(min_length=1)
    path: RelativePath = Field("", description="The model folder inside the claim; empty = its root.")


class HubSource(SpecModel):
    id: HubId = Field(description="A hub id, e.g. BAAI/bge-small-en-v1.5 (never a folder).")
    revision: RelativePath = Field("", description="A branch, tag or commit; empty = the default branch.")
    cache_claim_name: str = Field("", description="A PVC for the download cache; empty = an emptyDir per pod.")
    cache_size_limit: Quantity = "20Gi"


class ModelSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel("!(has(self.pvc) && has(self.hub))", "set model.pvc or model.hub, not both")
    )

    pvc: PvcSource | None = Field(None, description="A model folder on a PersistentVolumeClaim, mounted read-only.")
    hub: HubSource | None = Field(
        None, description="A Hugging Face hub model id, downloaded into a cache volume at start."
    )
    pooling: Pooling = Pooling.AUTO
    control_tokens: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description='Tokens left out of pooling, e.g. "[query]"; each reaches the server as written.',
    )
    max_input_tokens: int = Field(0, ge=0, description="0 = the model's limit.")
    dtype: Dtype = Dtype.AUTO
    served_name: str = Field("", description="A name REST clients may give as `model`, besides the model id.")
    default_prompt_name: PromptName | None = Field(
        None,
        description="The prompt put before a text whose request picks none (KEMBED_DEFAULT_PROMPT_NAME); unset = "
        "the model folder's default_prompt_name, if any. One the model does not have stops the server's start.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.pvc is not None and self.hub is not None:
            raise ValueError("set model.pvc or model.hub, not both")
        return self


class CompileCacheSpec(SpecModel):
    enabled: bool = True
    size_limit: Quantity = Field("5Gi", description="Of the emptyDir.")
    claim_name: str = Field(
        "",
        description="A PVC instead of the emptyDir, which survives pods too (ReadWriteMany when replicas share it); "
        "the operator's administrator must allow it (allowCompileCacheClaims).",
    )


class ResourcesSpec(SpecModel):
    gpu: int = Field(1, ge=0, description="GPUs per pod (nvidia.com/gpu); 0 = CPU.")
    cpu: Quantity = "4"
    memory: Quantity = "16Gi"


class BatchingSpec(SpecModel):
    mode: Batching = Batching.TOKEN_BUCKET
    buckets: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        max_length=16,
        json_schema_extra={
            **cel("self.isSorted()", "bucket lengths must be ascending"),
            "x-kubernetes-list-type": "set",
        },
    )
    max_batch_size: int | None = Field(None, ge=1, le=4096)
    max_tokens_per_batch: int | None = Field(None, ge=16)
    max_wait_ms: float | None = Field(None, ge=0)


class AdmissionSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            "!has(self.p95SoftMs) || !has(self.p95HardMs) || self.p95SoftMs <= self.p95HardMs",
            "p95SoftMs must not exceed p95HardMs",
        )
    )

    strategies: list[Admission] = Field(
        default_factory=lambda: list(Admission),  # every one the server has
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    max_drain_ms: float | None = Field(None, gt=0)
    p95_soft_ms: float | None = Field(None, gt=0)
    p95_hard_ms: float | None = Field(None, gt=0)
    latency_window_seconds: float | None = Field(None, gt=0)
    max_queued_tokens: int | None = Field(None, ge=1)


class LongInputsSpec(SpecModel):
    chunk: bool | None = Field(
        None,
        description="Embed an input longer than the model's limit as chunks, their vectors averaged by their "
        "tokens, where a request sets neither `chunk` nor `truncate`; unset = the server's default (off).",
    )
    max_chunks: int | None = Field(None, ge=1, description="The most chunks one input is embedded as.")


class SloSpec(SpecModel):
    p95_latency_ms: int = Field(
        1000,
        ge=1,
        description="The P95 latency objective; admission thresholds and autoscaling targets follow from it.",
    )


class AutoscalingTargets(SpecModel):
    demand_ratio: float | None = Field(
        None,
        gt=0,
        description="The utilisation to scale to: work offered (refusals included) over a pod's capacity; unset = 0.7.",
    )
    queue_drain_seconds: float | None = Field(None, gt=0, description="A guard: unset = 0.4 x slo.p95LatencyMs.")
    latency_p95_seconds: float | None = Field(None, gt=0, description="A guard: unset = slo.p95LatencyMs.")


class KedaSpec(SpecModel):
    server_address: str = Field(
        "",
        description="Deprecated: KEDA queries the Prometheus the operator's administrator names (kedaServerAddress); "
        "a value here must be empty or that address.",
    )
    polling_interval: int = Field(15, ge=1)
    cooldown_period: int = Field(300, ge=0)


class AutoscalingSpec(SpecModel):
    enabled: bool = True
    provider: Literal["hpa", "keda"] = "hpa"
    targets: AutoscalingTargets = Field(
        default_factory=AutoscalingTargets,
        description="Per-pod averages to scale on; unset = the demand at 0.7, the guards from slo.p95LatencyMs.",
    )
    behavior: Verbatim | None = Field(
        None,
        description="autoscaling/v2 HorizontalPodAutoscalerBehavior, passed through verbatim; unset = the "
        "operator's (scale up at once, down after 120 s, by at most half the pods a minute).",
    )
    keda: KedaSpec = Field(default_factory=KedaSpec)


class ServiceSpec(SpecModel):
    type: Literal["ClusterIP", "Headless"] = Field(
        "ClusterIP", description="Headless publishes every ready pod in DNS, for clients that balance per call."
    )
    annotations: dict[str, str] = Field(default_factory=dict)


class TlsSpec(SpecModel):
    secret_name: str = Field(
        min_length=1, description="A kubernetes.io/tls Secret (tls.crt, tls.key), e.g. cert-manager's."
    )
    # ("CA", not to_camel's "Ca".)
    client_ca_secret_name: str = Field(
        "",
        alias="clientCASecretName",
        description="A Secret whose ca.crt signs client certificates: mTLS. Only ca.crt is mounted.",
    )


class ApiKeySpec(SpecModel):
    secret_name: str = Field(
        min_length=1,
        description="A Secret in the resource's namespace whose key holds the API keys, one a line (several: "
        "rotation). Clients must send one as `Authorization: Bearer KEY` (REST) or `authorization` metadata "
        "(gRPC); health and metrics stay open.",
    )
    key: Annotated[
        str,
        matching(SECRET_KEY_PATTERN, "a Secret key (letters, digits, '-', '_', '.')"),
        Field(max_length=253, json_schema_extra={"pattern": SECRET_KEY_PATTERN}),
    ] = Field("api-keys", description="The Secret's key that holds them; only it is mounted.")


class TracingSpec(SpecModel):
    enabled: bool = Field(True, description="false = no spans, whatever the operator's default endpoint.")
    otlp_endpoint: OtlpEndpoint | None = Field(
        None,
        description="The OTLP/HTTP collector's base URL (OTEL_EXPORTER_OTLP_ENDPOINT; the SDK appends /v1/traces), "
        "e.g. http://otel-collector.observability:4318; unset = the operator's default, if it has one.",
    )
    service_name: str | None = Field(
        None, min_length=1, max_length=256, description="OTEL_SERVICE_NAME; unset = the resource's name."
    )
    sample_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="The share of traces started here that are kept (parentbased_traceidratio: a caller's sampled "
        "traceparent is always followed); unset = the operator's default (1).",
    )


class IpBlock(SpecModel):
    cidr: str
    except_: list[str] | None = Field(None, alias="except")


class NetworkPolicyPeer(SpecModel):
    """A networking.k8s.io/v1 NetworkPolicyPeer."""

    pod_selector: Verbatim | None = None
    namespace_selector: Verbatim | None = None
    ip_block: IpBlock | None = None


class NetworkPolicySpec(SpecModel):
    enabled: bool = True
    from_: list[NetworkPolicyPeer] = Field(
        default_factory=list,
        alias="from",
        description="More peers allowed to call gRPC and REST (other namespaces, pods, CIDRs).",
    )
    metrics_from: list[NetworkPolicyPeer] = Field(
        default_factory=list,
        description="Peers allowed to scrape the metrics port (e.g. Prometheus's namespace); "
        "empty = the operator's default.",
    )


class Toleration(SpecModel):
    """A core/v1 Toleration; the operator's administrator decides which taint keys a spec may tolerate."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(SpecModel):
    """A core/v1 EnvVar; which names a spec may set is the operator's administrator's decision."""

    name: str = Field(min_length=1)
    value: str | None = None
    value_from: Verbatim | None = None

    def manifest(self) -> dict[str, Any]:
        # The API server drops `value: ""`: spelt as no value, it is no false drift.
        return {k: v for k, v in super().manifest().items() if v != ""}


class PodOptions(SpecModel):
    """What a resource passes to its pods verbatim, within what the operator's administrator allows
    (:mod:`kembed_operator.trust`)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taint keys must match the operator's allowedTolerations."
    )
    affinity: Verbatim | None = Field(
        None,
        description="core/v1 Affinity; each of its kinds (nodeAffinity, podAffinity, podAntiAffinity) must be in "
        "the operator's allowedAffinity.",
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Keys must match the operator's allowedPodAnnotations."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Container variables (core/v1 EnvVar); each name must be one the operator allows "
        "(docs/operator.md, Who may do what).",
    )


class EmbeddingServiceSpec(PodOptions):
    model_config = ConfigDict(
        json_schema_extra=cel(
            "!has(self.maxReplicas) || self.maxReplicas >= self.minReplicas",
            "maxReplicas must not be below minReplicas",
        )
    )

    model: ModelSpec = Field(
        default_factory=ModelSpec,
        description="Where the model comes from (neither source = the bundled all-MiniLM-L6-v2) and how it pools.",
    )
    image: str = Field("", description="The server image; empty = the operator's default.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    min_replicas: int = Field(
        1, ge=1, le=REPLICAS_CEILING, description="At most the operator's maxReplicas (its administrator's limit)."
    )
    max_replicas: int | None = Field(
        None,
        ge=1,
        le=REPLICAS_CEILING,
        description="Unset = minReplicas (no autoscaling); at most the operator's maxReplicas.",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    batching: BatchingSpec = Field(
        default_factory=BatchingSpec,
        description="Passed to the server as KEMBED_* variables; unset = the server's defaults.",
    )
    admission: AdmissionSpec = Field(
        default_factory=AdmissionSpec,
        description="The server's load shedding; unset thresholds are derived from slo.p95LatencyMs.",
    )
    long_inputs: LongInputsSpec = Field(
        default_factory=LongInputsSpec,
        description="Inputs longer than the model's limit; unset = the server's defaults (refused unless a "
        "request asks for `chunk` or `truncate`).",
    )
    slo: SloSpec = Field(default_factory=SloSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    tls: TlsSpec | None = Field(
        None,
        description="TLS on the gRPC port, from Secrets mounted read-only; renewals reach new connections "
        "without a restart.",
    )
    api_key: ApiKeySpec | None = Field(
        None,
        description="Require an API key on gRPC and REST, from a Secret mounted read-only (KEMBED_API_KEY_FILE); "
        "an EmbeddingJob calling this service sends the first key of the same Secret.",
    )
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        description="A NetworkPolicy admitting gRPC and REST from this namespace and `from`, and the metrics port "
        "from `metricsFrom`.",
    )
    tracing: TracingSpec = Field(
        default_factory=TracingSpec,
        description="OpenTelemetry spans of answered calls, exported over OTLP/HTTP when an endpoint is set, here or "
        "by the operator (docs/operations.md); the image needs kembed's otel extra, which the default image has.",
    )
    compile_cache: CompileCacheSpec = Field(
        default_factory=CompileCacheSpec,
        description="torch's compile caches, so a restarted container skips most of its compile work.",
    )
    startup_timeout_seconds: int | None = Field(
        None,
        ge=10,
        description="Model load + warmup + CUDA graph capture; unset = derived from the planned shapes "
        "(docs/operator.md).",
    )
    # No schema default for either grace field: the API server would store it on every resource,
    # where it would outrank a drainSeconds the resource sets.
    termination_grace_seconds: int | None = Field(
        None,
        ge=0,
        description=f"After SIGTERM, how long a pod may go on finishing the requests it accepted; unset = "
        f"{DEFAULT_GRACE_SECONDS}. The pod's terminationGracePeriodSeconds adds 10 to it (a 5 s preStop sleep "
        "before, 5 s of margin after).",
    )
    drain_seconds: int | None = Field(
        None, ge=0, description="Deprecated alias of terminationGraceSeconds, which wins when both are set."
    )

    @model_validator(mode="after")
    def _replica_range(self) -> EmbeddingServiceSpec:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"maxReplicas ({self.max_replicas}) is below minReplicas ({self.min_replicas})")
        return self

    @property
    def grace_seconds(self) -> int:
        """``terminationGraceSeconds``, else the deprecated ``drainSeconds``, else the default."""
        for seconds in (self.termination_grace_seconds, self.drain_seconds):
            if seconds is not None:
                return seconds
        return DEFAULT_GRACE_SECONDS

    @property
    def replica_ceiling(self) -> int:
        return self.min_replicas if self.max_replicas is None else self.max_replicas

    @property
    def autoscaled(self) -> bool:
        """Whether an autoscaler owns the replica count (and the operator must leave it alone)."""
        return self.autoscaling.enabled and self.replica_ceiling > self.min_replicas


Spec = TypeVar("Spec", bound=SpecModel)


def parse(model: type[Spec], raw: dict[str, Any]) -> Spec:
    """The typed spec, or :class:`InvalidSpec` naming every bad field in the CRD's spelling."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        problems = [
            f"{'.'.join(['spec', *(str(p) for p in e['loc'])])}: {e['msg'].removeprefix('Value error, ')}"
            for e in err.errors()
        ]
        raise InvalidSpec("; ".join(problems)) from None


def parse_spec(raw: dict[str, Any]) -> EmbeddingServiceSpec:
    return parse(EmbeddingServiceSpec, raw)
