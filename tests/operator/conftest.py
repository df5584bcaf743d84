"""Shared fixtures: the CRD, the chart, the emulated API server and a real `kopf run` of the operator."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from kembed_operator import identity, kinds
from tests.operator.emulator import TEST_AGENT, EmulatorThread

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "embeddingservices.kembed.io.yaml"
JOB_CRD_PATH = ROOT / "crds" / "embeddingjobs.kembed.io.yaml"
CHART = ROOT / "charts" / "kembed-operator"

RESOURCES = {
    f"{kinds.EMBEDDING_SERVICE.api_version}/{identity.PLURAL}": {
        "kind": identity.KIND,
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
        "subresources": {"status", "scale"},
    },
    f"{kinds.EMBEDDING_JOB.api_version}/{identity.JOB_PLURAL}": {
        "kind": identity.JOB_KIND,
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
        "subresources": {"status"},
    },
    "kopf.dev/v1/clusterkopfpeerings": {
        "kind": "ClusterKopfPeering",
        "namespaced": False,
        "verbs": {"list", "watch", "get", "create", "patch"},
    },
    "kopf.dev/v1/kopfpeerings": {  # leader election of a namespaced install
        "kind": "KopfPeering",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch"},
    },
    "keda.sh/v1alpha1/scaledobjects": {
        "kind": "ScaledObject",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
    },
    # A built-in kind, missing from kmock's bundled resource list.
    "networking.k8s.io/v1/networkpolicies": {
        "kind": "NetworkPolicy",
        "namespaced": True,
        "verbs": {"list", "watch", "get", "create", "patch", "delete"},
    },
}


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def job_crd() -> dict[str, Any]:
    return yaml.safe_load(JOB_CRD_PATH.read_text())


@pytest.fixture(scope="session")
def job_crd_schema(job_crd: dict[str, Any]) -> dict[str, Any]:
    return job_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 120.0, interval: float = 0.2) -> Any:
    """Poll ``probe`` until it returns something truthy (returned); fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    with EmulatorThread(RESOURCES) as thread:
        yield thread


@pytest.fixture(scope="module")
def kubeconfig(emulator: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kube") / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": f"http://127.0.0.1:{emulator.port}"}}],
                "users": [{"name": "kmock", "user": {"token": "test"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def api(kubeconfig: Path) -> client.ApiClient:
    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.user_agent = TEST_AGENT  # tells the tests' own calls apart from the operator's
    return api


def render_chart(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's templates rendered offline, as manifests."""
    import helm_python

    files = helm_python.Chart.load(str(CHART)).render(
        values or {}, name="kembed", namespace="kembed-system", is_install=True
    )
    texts = [text for path, text in sorted(files.items()) if path.endswith(".yaml")]
    return [doc for text in texts for doc in yaml.safe_load_all(text) if doc]


def chart_operator(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The operator container of the chart's Deployment."""
    (deployment,) = [d for d in render_chart(values) if d["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def chart_operator_args(values: dict[str, Any] | None = None) -> list[str]:
    """The arguments the chart's operator Deployment passes to the image's `kopf` entrypoint."""
    return list(chart_operator(values)["args"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def health_url() -> str:
    return f"http://127.0.0.1:{free_port()}/healthz"


@pytest.fixture(scope="module")
def peering(api: client.ApiClient) -> str:
    """The ClusterKopfPeering the chart installs, named as the chart's arguments name it."""
    name = next(a.split("=", 1)[1] for a in chart_operator_args() if a.startswith("--peering="))
    body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
    client.CustomObjectsApi(api).create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body)
    return name


PROMETHEUS_URL = "http://prometheus.monitoring.svc:9090"  # the e2e operator's kedaServerAddress


def start_operator(
    kubeconfig: Path,
    log_path: Path,
    health_url: str = "",
    env: dict[str, str] | None = None,
    values: dict[str, Any] | None = None,
    modules: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """``kopf run`` with the arguments and environment of the chart rendered with ``values`` (peering
    included) against the emulator; ``env`` adds to that environment, ``modules`` to its modules."""
    container = chart_operator(values)
    args = [a for a in container["args"] if not a.startswith("--liveness=")]
    args += [f"--module={module}" for module in modules]
    args += [f"--liveness={health_url}"] if health_url else []  # two operators cannot share a port
    chart_env = {e["name"]: e["value"] for e in container["env"]}
    full_env = {**os.environ, **chart_env, "KUBECONFIG": str(kubeconfig), **(env or {})}
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kopf", *args, "--verbose"], env=full_env, stdout=log, stderr=subprocess.STDOUT
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait(10)


@pytest.fixture(scope="module")
def operator_process(
    kubeconfig: Path, peering: str, health_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """One operator for a whole test module; always killed."""
    log_path = tmp_path_factory.mktemp("kopf") / "kopf.log"
    process = start_operator(kubeconfig, log_path, health_url, values={"kedaServerAddress": PROMETHEUS_URL})
    try:
        yield process
    finally:
        stop(process)
        print(f"kopf log: {log_path}")
