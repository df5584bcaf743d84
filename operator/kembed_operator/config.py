"""The operator's own configuration, from ``KEMBED_OPERATOR_*`` environment variables (set by the chart)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kembed.contract import OPERATOR_ENV_PREFIX as PREFIX
from kembed_operator.spec import REPLICAS_CEILING


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str = "ghcr.io/kembed/kembed-server:0.1.0"
    # The Prometheus every ScaledObject queries (KEDA appends /api/v1/query?query=...); empty = no KEDA.
    keda_server_address: str = ""
    peering_lifetime_s: int = 60  # how long a silent leader holds its lease before a standby takes over
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
    max_replicas: int = 100

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """The configuration; :class:`ValueError` naming the variable when one is malformed."""
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            default_image=env.get(PREFIX + "DEFAULT_IMAGE", defaults.default_image),
            keda_server_address=_prometheus(
                PREFIX + "KEDA_SERVER_ADDRESS", env.get(PREFIX + "KEDA_SERVER_ADDRESS", defaults.keda_server_address)
            ),
            peering_lifetime_s=int(env.get(PREFIX + "PEERING_LIFETIME_S", defaults.peering_lifetime_s)),
            allowed_images=_patterns(env.get(PREFIX + "ALLOWED_IMAGES", "")),
            metrics_from=_peers(PREFIX + "METRICS_FROM", env.get(PREFIX + "METRICS_FROM", "[]")),
            allowed_env=_patterns(env.get(PREFIX + "ALLOWED_ENV", "")),
            allowed_pod_annotations=_patterns(env.get(PREFIX + "ALLOWED_POD_ANNOTATIONS", "")),
            allowed_tolerations=_patterns(env.get(PREFIX + "ALLOWED_TOLERATIONS", "")),
            allowed_affinity=_affinity(
                PREFIX + "ALLOWED_AFFINITY", env.get(PREFIX + "ALLOWED_AFFINITY", ",".join(defaults.allowed_affinity))
            ),
            allow_compile_cache_claims=_flag(
                PREFIX + "ALLOW_COMPILE_CACHE_CLAIMS", env.get(PREFIX + "ALLOW_COMPILE_CACHE_CLAIMS", "false")
            ),
            max_replicas=_bounded(
                PREFIX + "MAX_REPLICAS", env.get(PREFIX + "MAX_REPLICAS", str(defaults.max_replicas)), REPLICAS_CEILING
            ),
        )


def _patterns(text: str) -> tuple[str, ...]:
    """Comma-separated (image references, variable names and annotation keys hold no commas or spaces)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


AFFINITY_KINDS = ("nodeAffinity", "podAffinity", "podAntiAffinity")


def _affinity(name: str, text: str) -> tuple[str, ...]:
    kinds = _patterns(text)
    if unknown := [kind for kind in kinds if kind not in AFFINITY_KINDS]:
        raise ValueError(f"{name}: {', '.join(unknown)} is not one of {', '.join(AFFINITY_KINDS)}")
    return kinds


def _flag(name: str, text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"{name}: must be true or false, not {text!r}")
    return text.lower() == "true"


def _prometheus(name: str, text: str) -> str:
    """An http(s) URL with a host and nothing after its path, to which KEDA appends its query."""
    url = urlsplit(text)
    if text and (url.scheme not in ("http", "https") or not url.hostname or "?" in text or "#" in text):
        raise ValueError(f"{name}: must be an http(s) URL of Prometheus, without a query or fragment, not {text!r}")
    return text


def _bounded(name: str, text: str, ceiling: int) -> int:
    if not text.isdigit() or not 1 <= int(text) <= ceiling:
        raise ValueError(f"{name}: must be a whole number from 1 to {ceiling}, not {text!r}")
    return int(text)


def _peers(name: str, text: str) -> tuple[dict[str, Any], ...]:
    """A JSON list of NetworkPolicyPeers, each naming at least one of the peer fields and nothing else."""
    try:
        peers = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{name}: not JSON ({err})") from None
    fields = {"podSelector", "namespaceSelector", "ipBlock"}
    if not isinstance(peers, list) or not all(isinstance(p, dict) and p and set(p) <= fields for p in peers):
        raise ValueError(f"{name}: must be a list of NetworkPolicyPeers ({', '.join(sorted(fields))})")
    return tuple(peers)
