"""What a resource's author may choose beyond what RBAC lets them create (pure).

Creating an EmbeddingService or an EmbeddingJob is running an image in its namespace, with the
namespace's Secrets and claims. The operator's administrator decides (the chart's values) which
images may run and what a spec may hand to its pods, so that an allowed image runs only its own
code. A spec that asks for more is not reconciled: its children stay as they are and the status
names every field refused (:class:`NotAllowed`).

- ``image``: the default image, or one matching ``allowedImages``.
- ``env``: an EmbeddingService may set the server's ``KEMBED_*`` settings (those its spec does not
  render), ``TORCHINDUCTOR_COMPILE_THREADS`` and the names in ``allowedEnv``; an EmbeddingJob, whose
  client reads no setting, only the names in ``allowedEnv``. Anything else could turn the image into
  a loader of the author's code: ``PYTHONPATH``, ``LD_PRELOAD`` or ``HOME`` pointing into a claim
  they write. ``KEMBED_TRUST_REMOTE_CODE`` runs a model's own code, so it too needs ``allowedEnv``.
- ``podAnnotations``: keys matching ``allowedPodAnnotations`` (AppArmor, seccomp and mesh
  annotations change what confines or fronts the pod).
- ``tolerations``: taint keys matching ``allowedTolerations`` (a taint keeps pods off nodes kept for
  others); a toleration without a key tolerates every taint and needs a pattern matching ``""``.
- ``affinity``: the kinds in ``allowedAffinity`` (by default nodeAffinity and podAntiAffinity, which
  only narrow or spread placement; podAffinity places pods beside pods the author picks).
- ``nodeSelector`` passes: it only narrows where a pod may go.
- ``compileCache.claimName``: only with ``allowCompileCacheClaims``: whoever writes that claim can
  plant compiled code that every server mounting it loads.
- ``minReplicas``, ``maxReplicas``: up to ``maxReplicas`` (the schema's ceiling is higher).
- ``autoscaling.keda.serverAddress``: empty, or the operator's ``kedaServerAddress``. KEDA fetches
  that URL (with a query appended) from its own namespace: an author's address could make it fetch
  any internal URL, or evaluate PromQL over other namespaces' metrics.
- ``tracing.otlpEndpoint`` passes: the resource's own pods POST their spans there, from the
  author's namespace, with no header the author chose (``OTEL_EXPORTER_OTLP_HEADERS`` is ``env``,
  so ``allowedEnv``'s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from kembed.config.settings import Settings
from kembed.contract import ENV_PREFIX, env_name
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import EmbeddingJobSpec
from kembed_operator.render import COMPILE_THREADS_VAR
from kembed_operator.spec import EmbeddingServiceSpec, InvalidSpec, PodOptions

TRUST_REMOTE_CODE_VAR = env_name("trust_remote_code")
# The server's own settings, as variables; one of them runs a model's code, and so is not like the others.
SERVER_VARIABLES = frozenset(env_name(name) for name in Settings.model_fields) - {TRUST_REMOTE_CODE_VAR}


@dataclass(frozen=True)
class Refusal:
    reason: str  # e.g. ImageNotAllowed: the condition's reason
    message: str  # names the field


class NotAllowed(InvalidSpec):
    """The spec asks for what the operator's configuration does not allow; ``reason`` is the first refusal's."""

    def __init__(self, refusals: list[Refusal]) -> None:
        super().__init__("; ".join(refusal.message for refusal in refusals), refusals[0].reason)
        self.refusals = refusals


def image_allowed(image: str, config: OperatorConfig) -> bool:
    """The default image (the administrator's choice) always; others when a pattern matches all of it."""
    return image == config.default_image or any(fnmatchcase(image, pattern) for pattern in config.allowed_images)


def check_service(spec: EmbeddingServiceSpec, config: OperatorConfig) -> None:
    """:class:`NotAllowed` unless everything the server pods would be given is allowed."""
    refusals = _image(spec.image or config.default_image, config)
    may_set = f"an EmbeddingService may set the server's {ENV_PREFIX}* settings, {COMPILE_THREADS_VAR} and allowedEnv"
    refusals += _pod_options(spec, config, may_set, _server_variable)
    refusals += _replicas(spec, config) + _prometheus(spec, config)
    if spec.compile_cache.claim_name and not config.allow_compile_cache_claims:
        refusals.append(
            Refusal(
                "CompileCacheClaimNotAllowed",
                f"spec.compileCache.claimName: {spec.compile_cache.claim_name!r} is not allowed: whoever writes a "
                "compile cache can plant code every server mounting it loads; the operator's administrator allows "
                "it (allowCompileCacheClaims), or leave it empty for an emptyDir per pod",
            )
        )
    _enforce(refusals)


def check_job(spec: EmbeddingJobSpec, image: str, config: OperatorConfig) -> None:
    """:class:`NotAllowed` unless ``image`` (what the job's pods would run) and their options are allowed."""
    may_set = "an EmbeddingJob's pods run the client, which reads no setting: it may set allowedEnv"
    _enforce(_image(image, config) + _pod_options(spec, config, may_set, lambda _: False))


def _enforce(refusals: list[Refusal]) -> None:
    if refusals:
        raise NotAllowed(refusals)


def _image(image: str, config: OperatorConfig) -> list[Refusal]:
    if image_allowed(image, config):
        return []
    patterns = ", ".join(config.allowed_images) or "none"
    return [
        Refusal(
            "ImageNotAllowed",
            f"spec.image: {image!r} is not allowed by the operator: it runs {config.default_image!r} and images "
            f"matching its allowedImages ({patterns}); ask its administrator, or leave spec.image empty",
        )
    ]


def _replicas(spec: EmbeddingServiceSpec, config: OperatorConfig) -> list[Refusal]:
    if spec.replica_ceiling <= config.max_replicas:
        return []
    field = "minReplicas" if spec.max_replicas is None else "maxReplicas"
    return [
        Refusal(
            "ReplicasNotAllowed",
            f"spec.{field}: {spec.replica_ceiling} replicas is more than the operator allows ({config.max_replicas}, "
            "its maxReplicas); ask its administrator",
        )
    ]


def _prometheus(spec: EmbeddingServiceSpec, config: OperatorConfig) -> list[Refusal]:
    address = spec.autoscaling.keda.server_address
    if address in ("", config.keda_server_address):
        return []
    return [
        Refusal(
            "PrometheusAddressNotAllowed",
            f"spec.autoscaling.keda.serverAddress: {address!r} is not allowed: KEDA queries the Prometheus the "
            f"operator's administrator names ({config.keda_server_address or 'none'}, its kedaServerAddress); "
            "leave it empty",
        )
    ]


def _server_variable(name: str) -> bool:
    return name in SERVER_VARIABLES or name == COMPILE_THREADS_VAR


def _pod_options(
    spec: PodOptions, config: OperatorConfig, may_set: str, variable_allowed: Callable[[str], bool]
) -> list[Refusal]:
    """``may_set`` says which variables the resource may set besides allowedEnv's."""
    refusals = [
        Refusal("EnvNotAllowed", f"spec.env[{index}]: {var.name} {_why_not(var.name, may_set, config)}")
        for index, var in enumerate(spec.env)
        if not (variable_allowed(var.name) or var.name in config.allowed_env)
    ]
    annotations = _listed(config.allowed_pod_annotations)
    refusals += [
        Refusal(
            "PodAnnotationNotAllowed",
            f"spec.podAnnotations: {key!r} is not allowed (the operator's allowedPodAnnotations: {annotations})",
        )
        for key in spec.pod_annotations
        if not any(fnmatchcase(key, pattern) for pattern in config.allowed_pod_annotations)
    ]
    tolerated = _listed(config.allowed_tolerations)
    refusals += [
        Refusal(
            "TolerationNotAllowed",
            f"spec.tolerations[{index}]: "
            f"{f'taint key {toleration.key!r}' if toleration.key else 'a toleration of every taint'} is not allowed "
            f"(the operator's allowedTolerations: {tolerated})",
        )
        for index, toleration in enumerate(spec.tolerations)
        if not any(fnmatchcase(toleration.key or "", pattern) for pattern in config.allowed_tolerations)
    ]
    affinities = _listed(config.allowed_affinity)
    refusals += [
        Refusal(
            "AffinityNotAllowed", f"spec.affinity.{kind}: not allowed (the operator's allowedAffinity: {affinities})"
        )
        for kind in spec.affinity or {}
        if kind not in config.allowed_affinity
    ]
    return refusals


def _why_not(name: str, may_set: str, config: OperatorConfig) -> str:
    if name == TRUST_REMOTE_CODE_VAR:
        return "runs the model's own code: the operator's administrator must name it in allowedEnv"
    typo = (
        "is not a kembed server setting, and " if name.startswith(ENV_PREFIX) and name not in SERVER_VARIABLES else ""
    )
    return f"{typo}is not allowed: {may_set} ({_listed(config.allowed_env)})"


def _listed(values: tuple[str, ...]) -> str:
    return ", ".join(values) or "none"
