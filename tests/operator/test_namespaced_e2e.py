"""End to end through the emulator: the chart's namespaced install with its trust settings.

A real `kopf run` with the arguments and environment the chart renders for ``VALUES``: it serves two
namespaces with Roles only (every request it makes must fit a Role there), runs only allowed images,
and admits the chart's Prometheus peers to the metrics port.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kembed_operator import permissions
from tests.operator.cluster import DEPLOYMENTS, Kube, condition, operator_calls, operator_requests
from tests.operator.conftest import render_chart, start_operator, stop, wait_for
from tests.operator.emulator import EmulatorThread

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
SERVED = ["team-a", "team-b"]
ALLOWED = "registry.example/kembed/*"
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
VALUES = {"watchNamespaces": SERVED, "allowedImages": [ALLOWED], "metricsFrom": [PROMETHEUS]}
POLICIES = "networking.k8s.io/v1/networkpolicies"


@pytest.fixture(scope="module")
def operator(
    api: client.ApiClient, kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """The chart's peering objects (a KopfPeering in each served namespace), then its operator."""
    custom = client.CustomObjectsApi(api)
    for doc in render_chart(VALUES):
        if doc["kind"] == "KopfPeering":
            body = {**doc, "metadata": {"name": doc["metadata"]["name"]}}
            custom.create_namespaced_custom_object("kopf.dev", "v1", doc["metadata"]["namespace"], "kopfpeerings", body)
    log_path = tmp_path_factory.mktemp("kopf") / "kopf.log"
    process = start_operator(kubeconfig, log_path, values=VALUES)
    try:
        yield process
    finally:
        stop(process)
        print(f"kopf log: {log_path}")


@pytest.fixture(scope="module")
def team_a(api: client.ApiClient, operator: subprocess.Popen[bytes]) -> Kube:
    return Kube(api, SERVED[0])


def test_only_the_served_namespaces_are_reconciled_with_roles_only(
    api: client.ApiClient, team_a: Kube, emulator: EmulatorThread
) -> None:
    elsewhere, team_b = Kube(api, "elsewhere"), Kube(api, SERVED[1])
    elsewhere.create_es("outside", resources={"gpu": 0})  # first: a cluster-wide watch would see it first
    team_a.create_es("inside", resources={"gpu": 0})
    team_b.create_es("inside", resources={"gpu": 0})
    for kube in (team_a, team_b):
        wait_for(f"the Deployment in {kube.namespace}", functools.partial(kube.child, DEPLOYMENTS, "inside"))
        wait_for(f"the status in {kube.namespace}", functools.partial(_status, kube, "inside"))
    outside = elsewhere.es("outside")
    assert "status" not in outside and not outside["metadata"].get("finalizers")
    assert elsewhere.child(DEPLOYMENTS, "outside") is None

    requests = operator_requests(emulator.requests())
    assert {request.namespace for request in requests} == set(SERVED)  # nothing cluster-wide, nothing else
    calls = set(operator_calls(requests))
    assert calls <= permissions.triples(permissions.NAMESPACED), calls - permissions.triples(permissions.NAMESPACED)
    assert ("kopf.dev", "kopfpeerings", "patch") in calls  # leader election ran, per namespace


def test_an_image_not_allowed_is_not_reconciled_and_the_status_says_why(team_a: Kube) -> None:
    team_a.create_es("rogue", image="evil.example/miner:1", resources={"gpu": 0})
    es = wait_for(
        "ImageNotAllowed", lambda: condition(es := team_a.es("rogue"), "Degraded").get("status") == "True" and es
    )
    degraded = condition(es, "Degraded")
    assert degraded["reason"] == condition(es, "Ready")["reason"] == "ImageNotAllowed"
    assert "evil.example/miner:1" in degraded["message"] and ALLOWED in degraded["message"]
    assert team_a.child(DEPLOYMENTS, "rogue") is None
    wait_for("a Warning event", lambda: ("Warning", "ImageNotAllowed") in team_a.events("rogue"))

    allowed = "registry.example/kembed/server:2"
    team_a.create_es("changed", image=allowed, resources={"gpu": 0})
    wait_for("the allowed image", lambda: _image(team_a, "changed") == allowed)
    team_a.patch_es("changed", {"image": "evil.example/miner:1", "minReplicas": 2})
    wait_for("ImageNotAllowed", lambda: condition(team_a.es("changed"), "Degraded").get("reason") == "ImageNotAllowed")
    deployment = team_a.child(DEPLOYMENTS, "changed") or {}
    assert (_image(team_a, "changed"), deployment["spec"]["replicas"]) == (allowed, 1)  # the last allowed spec
    team_a.patch_es("changed", {"image": allowed})
    wait_for("two replicas", lambda: (team_a.child(DEPLOYMENTS, "changed") or {})["spec"]["replicas"] == 2)
    wait_for("Degraded cleared", lambda: condition(team_a.es("changed"), "Degraded").get("status") == "False")


def test_the_charts_metrics_peers_admit_prometheus(team_a: Kube) -> None:
    team_a.create_es("scaled", maxReplicas=3, resources={"gpu": 0})
    policy = wait_for("the policy", lambda: team_a.child(POLICIES, "scaled"))
    assert policy["spec"]["ingress"][1]["from"] == [PROMETHEUS]
    admitted = wait_for("MetricsAdmitted", lambda: condition(team_a.es("scaled"), "MetricsAdmitted"))
    assert (admitted["status"], admitted["reason"]) == ("True", "PeersAdmitted")


def _status(kube: Kube, name: str) -> dict[str, Any]:
    return dict(kube.es(name).get("status") or {})


def _image(kube: Kube, name: str) -> str | None:
    deployment = kube.child(DEPLOYMENTS, name)
    return None if deployment is None else str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])
