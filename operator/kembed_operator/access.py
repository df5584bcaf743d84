"""Who may reach the server, and how (pure): the TLS Secret mounts and variables, and the NetworkPolicy.

The Secrets are mounted whole (never with ``subPath``): only then does the kubelet swap in a renewed
certificate, which the server picks up for new connections without a restart.
"""

from __future__ import annotations

from typing import Any

from kembed.contract import GRPC_PORT, HTTP_PORT
from kembed_operator.spec import EmbeddingServiceSpec, NetworkPolicySpec

Manifest = dict[str, Any]

TLS_DIR = "/etc/kembed/tls"
CLIENT_CA_DIR = "/etc/kembed/client-ca"
SECRET_MODE = 0o440  # group-readable: the pod's fsGroup owns Secret files, and the key is no one else's


def transport(spec: EmbeddingServiceSpec) -> str:
    """What a client must speak: ``plaintext``, ``tls`` or ``mtls`` (the status and its printer column)."""
    if spec.tls is None:
        return "plaintext"
    return "mtls" if spec.tls.client_ca_secret_name else "tls"


def tls_settings(spec: EmbeddingServiceSpec) -> dict[str, str]:
    """The server settings (field names) that point at the mounted files."""
    tls = spec.tls
    if tls is None:
        return {}
    settings = {"tls_cert_file": f"{TLS_DIR}/tls.crt", "tls_key_file": f"{TLS_DIR}/tls.key"}
    if tls.client_ca_secret_name:
        settings["tls_client_ca_file"] = f"{CLIENT_CA_DIR}/ca.crt"
    return settings


def tls_volumes(spec: EmbeddingServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts) for the Secrets, read-only."""
    tls = spec.tls
    if tls is None:
        return [], []
    volumes = [_secret_volume("tls", tls.secret_name, "tls.crt", "tls.key")]
    mounts = [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]
    if tls.client_ca_secret_name:
        # Only ca.crt: a CA's own Secret also holds its private key, which the server must never see.
        volumes.append(_secret_volume("client-ca", tls.client_ca_secret_name, "ca.crt"))
        mounts.append({"name": "client-ca", "mountPath": CLIENT_CA_DIR, "readOnly": True})
    return volumes, mounts


def _secret_volume(name: str, secret: str, *keys: str) -> Manifest:
    items = [{"key": key, "path": key} for key in keys]
    return {"name": name, "secret": {"secretName": secret, "items": items, "defaultMode": SECRET_MODE}}


def network_policy(metadata: Manifest, pod_labels: dict[str, str], policy: NetworkPolicySpec) -> Manifest:
    """Ingress only: gRPC from this namespace and ``from``, the HTTP port from ``metricsFrom``.

    Kubelet probes come from the node, which common CNIs always admit; everything else is refused.
    """
    ingress: list[Manifest] = [
        # An empty podSelector as a peer: every pod in the policy's own namespace.
        {"from": [{"podSelector": {}}, *policy.from_], "ports": [{"protocol": "TCP", "port": GRPC_PORT}]}
    ]
    if policy.metrics_from:
        ingress.append({"from": list(policy.metrics_from), "ports": [{"protocol": "TCP", "port": HTTP_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {"podSelector": {"matchLabels": pod_labels}, "policyTypes": ["Ingress"], "ingress": ingress},
    }
