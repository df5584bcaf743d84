"""The EmbeddingService spec as typed, checked values (pure).

The CRD's OpenAPI schema is the first line of defence and applies the same defaults as these
models (a test keeps the two identical), all but :data:`DEFAULT_GRACE_SECONDS`, which only this
module applies. This module is the second line: it rejects what a schema cannot express or what
got past it (an older CRD, a client that skipped validation), raising :class:`InvalidSpec`, which
the handlers turn into a ``Degraded`` condition instead of a crash.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from kembed.config import Admission, Batching, Dtype, Pooling


class InvalidSpec(ValueError):
    """The spec cannot be rendered; the message says which field and why, ``reason`` is the condition's."""

    reason: ClassVar[str] = "InvalidSpec"


# terminationGraceSeconds when neither it nor drainSeconds is set. The resource's own default, not
# the CRD's: a schema default would be stored on every resource and so outrank a drainSeconds.
DEFAULT_GRACE_SECONDS = 25

# The CRD accepts `cpu: 4` as well as `cpu: "4"` (int-or-string); manifests need the string.
Quantity = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int | float) else v)]


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class PvcSource(_Spec):
    claim_name: str = Field(min_length=1)
    path: str = ""  # the model folder inside the claim; empty = the claim's root


class HubSource(_Spec):
    id: str = Field(min_length=1)
    revision: str = ""
    cache_claim_name: str = ""  # empty = an emptyDir per pod (downloads on every start)
    cache_size_limit: Quantity = "20Gi"


class ModelSpec(_Spec):
    pvc: PvcSource | None = None
    hub: HubSource | None = None
    pooling: Pooling = Pooling.AUTO
    control_tokens: list[str] = Field(default_factory=list)
    max_input_tokens: int = Field(0, ge=0)
    dtype: Dtype = Dtype.AUTO
    served_name: str = ""  # the REST API's `model` alias; empty = the model id only

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.pvc is not None and self.hub is not None:
            raise ValueError("set model.pvc or model.hub, not both")
        return self


class CompileCacheSpec(_Spec):
    """torch's compile caches: an emptyDir survives container restarts; a PVC survives pods too."""

    enabled: bool = True
    size_limit: Quantity = "5Gi"  # of the emptyDir
    claim_name: str = ""  # a PVC instead of the emptyDir (ReadWriteMany when replicas share it)


class ResourcesSpec(_Spec):
    gpu: int = Field(1, ge=0)
    cpu: Quantity = "4"
    memory: Quantity = "16Gi"


class BatchingSpec(_Spec):
    """Unset fields keep the server's defaults (docs/configuration.md)."""

    mode: Batching = Batching.TOKEN_BUCKET
    buckets: list[int] | None = None
    max_batch_size: int | None = Field(None, ge=1)
    max_tokens_per_batch: int | None = Field(None, ge=1)
    max_wait_ms: float | None = Field(None, ge=0)


class AdmissionSpec(_Spec):
    """Unset thresholds are derived from ``slo.p95LatencyMs`` (see :mod:`kembed_operator.slo`)."""

    strategies: list[Admission] = Field(default_factory=lambda: list(Admission))  # every one the server has
    max_drain_ms: float | None = Field(None, gt=0)
    p95_soft_ms: float | None = Field(None, gt=0)
    p95_hard_ms: float | None = Field(None, gt=0)
    latency_window_seconds: float | None = Field(None, gt=0)
    max_queued_tokens: int | None = Field(None, ge=1)


class SloSpec(_Spec):
    p95_latency_ms: int = Field(1000, ge=1)


class AutoscalingTargets(_Spec):
    """Per-pod averages the autoscaler aims for; unset = derived from the SLO."""

    queue_drain_seconds: float | None = Field(None, gt=0)
    latency_p95_seconds: float | None = Field(None, gt=0)


class KedaSpec(_Spec):
    server_address: str = ""  # empty = the operator's configured Prometheus
    polling_interval: int = Field(15, ge=1)
    cooldown_period: int = Field(300, ge=0)


class AutoscalingSpec(_Spec):
    enabled: bool = True
    provider: Literal["hpa", "keda"] = "hpa"
    targets: AutoscalingTargets = Field(default_factory=AutoscalingTargets)
    behavior: dict[str, Any] | None = None  # passed verbatim to the HPA (or KEDA's HPA)
    keda: KedaSpec = Field(default_factory=KedaSpec)


class ServiceSpec(_Spec):
    # Headless: DNS returns every ready pod, for gRPC clients that balance per call themselves.
    type: Literal["ClusterIP", "Headless"] = "ClusterIP"
    annotations: dict[str, str] = Field(default_factory=dict)


class TlsSpec(_Spec):
    secret_name: str = Field(min_length=1)  # a kubernetes.io/tls Secret (tls.crt, tls.key), e.g. cert-manager's
    # A Secret whose ca.crt signs client certificates: mTLS. ("CA", not to_camel's "Ca".)
    client_ca_secret_name: str = Field("", alias="clientCASecretName")


class NetworkPolicySpec(_Spec):
    """Ingress to the pods: gRPC from the resource's namespace and ``from``; metrics from ``metricsFrom``."""

    enabled: bool = True
    from_: list[dict[str, Any]] = Field(default_factory=list, alias="from")  # NetworkPolicyPeers, verbatim
    metrics_from: list[dict[str, Any]] = Field(default_factory=list)


class EmbeddingServiceSpec(_Spec):
    model: ModelSpec = Field(default_factory=ModelSpec)
    image: str = ""  # empty = the operator's default server image
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    min_replicas: int = Field(1, ge=1)
    max_replicas: int | None = Field(None, ge=1)  # unset = minReplicas (a fixed size)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    tls: TlsSpec | None = None
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    compile_cache: CompileCacheSpec = Field(default_factory=CompileCacheSpec)
    # unset = derived from the shapes warmed up and measured cold starts (kembed_operator.startup)
    startup_timeout_seconds: int | None = Field(None, ge=10)
    # After SIGTERM, how long a pod may go on finishing the requests it accepted (KEMBED_DRAIN_TIMEOUT_S).
    termination_grace_seconds: int | None = Field(None, ge=0)
    # Deprecated: this field's v1alpha1 name, still accepted; terminationGraceSeconds wins over it.
    drain_seconds: int | None = Field(None, ge=0)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    env: list[dict[str, Any]] = Field(default_factory=list)

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


def parse_spec(raw: dict[str, Any]) -> EmbeddingServiceSpec:
    """The typed spec, or :class:`InvalidSpec` naming every bad field in the CRD's spelling."""
    try:
        return EmbeddingServiceSpec.model_validate(raw)
    except ValidationError as err:
        problems = [f"{'.'.join(['spec', *(str(p) for p in e['loc'])])}: {e['msg']}" for e in err.errors()]
        raise InvalidSpec("; ".join(problems)) from None
