"""The operator image as built (``make image``), started as the chart's Deployment runs it (its
arguments, environment, security contexts and memory limit) on the host's network, against the
test suite's emulated API server: it reconciles an EmbeddingService into a Deployment.

The chart's pod reaches the API through its service account; here a kubeconfig, mounted read-only,
points the same command at the emulator on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.image.podman import Container, http_status
from tests.operator.cluster import DEPLOYMENTS, Kube
from tests.operator.conftest import api, emulator, free_port, kubeconfig, peering, render_chart, wait_for  # noqa: F401
from tests.server.serving import wait_until

pytestmark = [pytest.mark.image, pytest.mark.process, pytest.mark.timeout(300)]

KUBECONFIG = "/etc/kembed/kubeconfig"


@pytest.fixture(scope="module")
def chart_deployment() -> dict[str, Any]:
    """The chart's operator Deployment, its health port a free one: the pod shares the host's network."""
    (deployment,) = [doc for doc in render_chart({"healthPort": free_port()}) if doc["kind"] == "Deployment"]
    return dict(deployment)


@pytest.fixture(scope="module")
def operator(
    operator_image: str,
    chart_deployment: dict[str, Any],
    kubeconfig: Path,  # noqa: F811
    peering: str,  # noqa: F811
) -> Iterator[Container]:
    pod = chart_deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mount = ["--volume", f"{kubeconfig}:{KUBECONFIG}:ro", "--env", f"KUBECONFIG={KUBECONFIG}"]
    run = Container(operator_image, pod, container, host_ports=None, extra=mount)
    probe = container["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
    try:
        url = f"http://127.0.0.1:{port}{probe['path']}"
        wait_until(lambda: http_status(url) == 200 or not run.running(), 120, "the operator's liveness probe")
        assert run.running(), run.logs()
        yield run
    finally:
        print(run.logs()[-4000:])
        run.remove()


def test_reconciles_an_embedding_service(
    operator: Container,
    api: client.ApiClient,  # noqa: F811
    chart_deployment: dict[str, Any],
) -> None:
    kube = Kube(api)
    uid = kube.create_es("imaged", resources={"gpu": 0})
    deployment = wait_for("the Deployment", lambda: kube.child(DEPLOYMENTS, "imaged"))
    (owner,) = deployment["metadata"]["ownerReferences"]
    assert owner["uid"] == uid
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {var["name"]: var["value"] for var in chart_deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert server["image"] == env["KEMBED_OPERATOR_DEFAULT_IMAGE"]  # the chart's serverImage reached the operator
    assert operator.running()
