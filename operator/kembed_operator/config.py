"""The operator's own configuration, from ``KEMBED_OPERATOR_*`` environment variables (set by the chart).

Read like the server's settings (:func:`kembed.config.env.read_env`): an unknown ``KEMBED_OPERATOR_*``
name or a bad value stops start-up with :class:`~kembed.config.values.ConfigError` naming the variable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kembed.config.env import read_env
from kembed.contract import OPERATOR_ENV_PREFIX
from kembed_operator.spec import OTLP_ENDPOINT_PATTERN, REPLICAS_CEILING

AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
# The server image's name before anyone builds one: no registry has it (`make image` builds it, and
# its builder pushes it where the cluster pulls from, chart value serverImage).
UNPUBLISHED_IMAGE = "ghcr.io/kembed/kembed-server:0.1.0"
PEER_FIELDS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


class OperatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default_image: str = UNPUBLISHED_IMAGE
    # The Prometheus every ScaledObject queries (KEDA appends /api/v1/query?query=...); empty = no KEDA.
    keda_server_address: str = ""
    # How long a silent leader holds its lease before a standby takes over.
    peering_lifetime_s: int = Field(60, ge=1)
    # Glob patterns (fnmatch: `*` spans `/` too) a spec's image must match; the default image always may.
    allowed_images: tuple[str, ...] = ()
    # NetworkPolicyPeers admitted to the metrics port when a spec's networkPolicy.metricsFrom is empty.
    metrics_from: tuple[dict[str, Any], ...] = ()
    # What a spec may pass to its pods (kembed_operator.trust): variable names besides the server's
    # own settings, pod annotation keys and tolerated taint keys (glob patterns), and affinity kinds.
    allowed_env: tuple[str, ...] = ()
    allowed_pod_annotations: tuple[str, ...] = ()
    allowed_tolerations: tuple[str, ...] = ()
    allowed_affinity: tuple[str, ...] = ("nodeAffinity", "podAntiAffinity")
    # Whether a spec may keep torch's compile caches on a claim of its own: whoever writes that claim
    # can plant compiled code the servers load.
    allow_compile_cache_claims: bool = False
    # The most replicas a resource may ask for (minReplicas, maxReplicas), up to the schema's ceiling.
    max_replicas: int = Field(100, ge=1, le=REPLICAS_CEILING)
    # OpenTelemetry for every EmbeddingService whose spec.tracing names no endpoint: an OTLP/HTTP base
    # URL (empty = none), and the share of traces kept where spec.tracing.sampleRatio is unset.
    otlp_endpoint: str = ""
    trace_sample_ratio: float = Field(1.0, ge=0, le=1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        return read_env(cls, OPERATOR_ENV_PREFIX, environ)

    @field_validator(
        "allowed_images",
        "allowed_env",
        "allowed_pod_annotations",
        "allowed_tolerations",
        "allowed_affinity",
        mode="before",
    )
    @classmethod
    def _patterns(cls, value: Any) -> Any:
        """Comma-separated (image references, variable names and annotation keys hold no commas or spaces)."""
        return tuple(p.strip() for p in value.split(",") if p.strip()) if isinstance(value, str) else value

    @field_validator("allowed_affinity")
    @classmethod
    def _affinity(cls, kinds: tuple[str, ...]) -> tuple[str, ...]:
        if unknown := [kind for kind in kinds if kind not in AFFINITY_KINDS]:
            raise ValueError(f"{', '.join(unknown)} is not one of {', '.join(AFFINITY_KINDS)}")
        return kinds

    @field_validator("allow_compile_cache_claims", mode="before")
    @classmethod
    def _flag(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() not in ("true", "false"):
            raise ValueError(f"must be true or false, not {value!r}")
        return value

    @field_validator("keda_server_address")
    @classmethod
    def _prometheus(cls, text: str) -> str:
        """An http(s) URL with a host and nothing after its path, to which KEDA appends its query."""
        url = urlsplit(text)
        if text and (url.scheme not in ("http", "https") or not url.hostname or "?" in text or "#" in text):
            raise ValueError(f"must be an http(s) URL of Prometheus, without a query or fragment, not {text!r}")
        return text

    @field_validator("otlp_endpoint")
    @classmethod
    def _collector(cls, text: str) -> str:
        """Empty, or what a spec's tracing.otlpEndpoint may be."""
        if text and re.fullmatch(OTLP_ENDPOINT_PATTERN, text) is None:
            raise ValueError(f"must be an OTLP/HTTP collector's http(s) URL, with no query or fragment, not {text!r}")
        return text

    @field_validator("metrics_from", mode="before")
    @classmethod
    def _peers(cls, value: Any) -> Any:
        """A JSON list of NetworkPolicyPeers, each naming at least one of the peer fields and nothing else."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise ValueError(f"not JSON ({err})") from None
        if not isinstance(value, list | tuple) or not all(_peer(p) for p in value):
            raise ValueError(f"must be a list of NetworkPolicyPeers ({', '.join(sorted(PEER_FIELDS))})")
        return tuple(value)


def _peer(peer: Any) -> bool:
    return isinstance(peer, dict) and bool(peer) and set(peer) <= PEER_FIELDS
