"""Who may reach the server, and how (pure): the TLS and API key Secret mounts and variables, what a
corpus job's client mounts to reach it, the NetworkPolicy, and whether it lets Prometheus reach the
metrics the autoscaler needs.

The Secrets are mounted whole (never with ``subPath``): only then does the kubelet swap in a renewed
certificate (or a rotated key), which the server picks up without a restart. The operator only names
them in pod specs: it never reads a Secret, and needs no permission to.
"""

from __future__ import annotations

from kembed.contract import GRPC_PORT, HTTP_PORT, REST_PORT, env_name
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import JobTls
from kembed_operator.kinds import Manifest
from kembed_operator.spec import EmbeddingServiceSpec, InvalidSpec
from kembed_operator.status import Verdict

TLS_DIR = "/etc/kembed/tls"
CLIENT_CA_DIR = "/etc/kembed/client-ca"
# A corpus job's client: the CA its server's certificate chains to, and its own certificate for mTLS.
SERVER_CA_DIR = "/etc/kembed/server-ca"
CLIENT_TLS_DIR = "/etc/kembed/client-tls"
SECRET_MODE = 0o440  # group-readable: the pod's fsGroup owns Secret files, and the key is no one else's
# The API keys' Secret, in the server's pods and in a corpus job's (whose client sends the first).
API_KEY_DIR = "/etc/kembed/api-key"
API_KEY_FILE_VAR = env_name("api_key_file")  # the server's setting


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


def api_key_file(spec: EmbeddingServiceSpec) -> str | None:
    """Where the pods find the API keys, one a line; None when the spec asks for none."""
    return None if spec.api_key is None else f"{API_KEY_DIR}/{spec.api_key.key}"


def api_key_env(spec: EmbeddingServiceSpec) -> list[Manifest]:
    """The server's variable naming the key file, when the spec asks for a key."""
    path = api_key_file(spec)
    return [] if path is None else [{"name": API_KEY_FILE_VAR, "value": path}]


def api_key_volumes(spec: EmbeddingServiceSpec) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, volumeMounts) for the Secret's one key, read-only: the server's, and a corpus job's
    that calls it."""
    if spec.api_key is None:
        return [], []
    volume = _secret_volume("api-key", spec.api_key.secret_name, spec.api_key.key)
    return [volume], [{"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}]


def client_api_key(server: EmbeddingServiceSpec) -> tuple[list[str], list[Manifest], list[Manifest]]:
    """What a corpus job's client needs to call a ``server`` that requires a key: (arguments, volumes,
    volumeMounts). The same Secret as the server's: the client sends its first key."""
    path = api_key_file(server)
    return ([] if path is None else ["--api-key-file", path]), *api_key_volumes(server)


def client_tls(job: JobTls, server: EmbeddingServiceSpec) -> tuple[list[str], list[Manifest], list[Manifest]]:
    """What a corpus job's client needs to reach ``server``: (arguments, volumes, volumeMounts).

    Only ``ca.crt`` of a CA's Secret is mounted, never a key that is not the client's own: the
    default, the service's own TLS Secret, also holds the server's private key.
    """
    tls = server.tls
    if tls is None:
        return [], [], []
    volumes = [_secret_volume("server-ca", job.ca_secret_name or tls.secret_name, "ca.crt")]
    mounts = [{"name": "server-ca", "mountPath": SERVER_CA_DIR, "readOnly": True}]
    arguments = ["--ca-file", f"{SERVER_CA_DIR}/ca.crt"]
    if tls.client_ca_secret_name:
        if not job.client_secret_name:
            raise InvalidSpec(
                "spec.tls.clientSecretName: the service requires client certificates (mTLS): name a kubernetes.io/tls "
                f"Secret signed by the CA in its Secret {tls.client_ca_secret_name!r}"
            )
        volumes.append(_secret_volume("client-tls", job.client_secret_name, "tls.crt", "tls.key"))
        mounts.append({"name": "client-tls", "mountPath": CLIENT_TLS_DIR, "readOnly": True})
        arguments += ["--cert-file", f"{CLIENT_TLS_DIR}/tls.crt", "--key-file", f"{CLIENT_TLS_DIR}/tls.key"]
    return arguments, volumes, mounts


def _secret_volume(name: str, secret: str, *keys: str) -> Manifest:
    items = [{"key": key, "path": key} for key in keys]
    return {"name": name, "secret": {"secretName": secret, "items": items, "defaultMode": SECRET_MODE}}


def metrics_peers(spec: EmbeddingServiceSpec, config: OperatorConfig) -> list[Manifest]:
    """Who may reach the metrics port: ``metricsFrom``, or when it is empty the operator's default."""
    own = [peer.manifest() for peer in spec.network_policy.metrics_from]
    return own or list(config.metrics_from)


def network_policy_spec(pod_labels: dict[str, str], spec: EmbeddingServiceSpec, config: OperatorConfig) -> Manifest:
    """The NetworkPolicy's spec, ingress only: the APIs (gRPC and REST) from this namespace and
    ``from``, the HTTP port from :func:`metrics_peers`.

    Kubelet probes come from the node, which common CNIs always admit; everything else is refused.
    """
    ingress: list[Manifest] = [
        # An empty podSelector as a peer: every pod in the policy's own namespace.
        {
            "from": [{"podSelector": {}}, *(peer.manifest() for peer in spec.network_policy.from_)],
            "ports": [{"protocol": "TCP", "port": GRPC_PORT}, {"protocol": "TCP", "port": REST_PORT}],
        }
    ]
    if peers := metrics_peers(spec, config):
        ingress.append({"from": peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]})
    return {"podSelector": {"matchLabels": pod_labels}, "policyTypes": ["Ingress"], "ingress": ingress}


def metrics_admitted(spec: EmbeddingServiceSpec, config: OperatorConfig) -> Verdict:
    """Whether anything may scrape the metrics port: without it an autoscaler starves in silence.

    Only what the policy says: whether Prometheus really sits behind an admitted peer is not known here.
    """
    policy = spec.network_policy
    if not policy.enabled:
        return Verdict(True, "NoNetworkPolicy", "no NetworkPolicy: the metrics port is open to the cluster")
    if peers := metrics_peers(spec, config):
        source = "spec.networkPolicy.metricsFrom" if policy.metrics_from else "the operator's default metricsFrom"
        return Verdict(True, "PeersAdmitted", f"port {HTTP_PORT} admits {len(peers)} peer(s) from {source}")
    starved = "the autoscaler gets no metrics and cannot scale" if spec.autoscaled else "nothing can scrape them"
    return Verdict(
        False,
        "NoMetricsPeers",
        f"the NetworkPolicy admits no peer to the metrics port ({HTTP_PORT}), so {starved}: set "
        "spec.networkPolicy.metricsFrom to where Prometheus runs (or the operator's default, chart value metricsFrom)",
        alarming=spec.autoscaled,  # an autoscaler without metrics starves in silence
    )
