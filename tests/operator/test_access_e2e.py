"""End to end through the emulator: a real `kopf run` mounts the TLS Secrets, sets the variables,
reports the transport, and keeps a NetworkPolicy in line (created, repaired, removed).

The emulator stores a NetworkPolicy; it cannot enforce one. Enforcement needs a CNI that
implements NetworkPolicy (Calico, Cilium, ...): docs/operator.md says so.
"""

from __future__ import annotations

import subprocess
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client

from tests.operator.cluster import DEPLOYMENTS, Kube, condition, operator_calls
from tests.operator.conftest import wait_for
from tests.operator.emulator import EmulatorThread
from tests.operator.test_e2e import env_of
from tests.operator.test_render import K8S_VERSION

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
POLICIES = "networking.k8s.io/v1/networkpolicies"
SERVER_ONLY = {"creationTimestamp", "generation", "managedFields", "resourceVersion", "uid"}


@pytest.fixture(scope="module")
def kube(api: client.ApiClient, operator_process: subprocess.Popen[bytes]) -> Kube:
    return Kube(api)


def valid(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` after checking it strictly, as the operator sent it (without what the server stamps)."""
    sent = {k: v for k, v in manifest.items() if k != "status"}
    sent["metadata"] = {k: v for k, v in manifest["metadata"].items() if k not in SERVER_ONLY}
    kubernetes_validate.validate(sent, K8S_VERSION, strict=True)
    return manifest


def test_tls_secrets_are_mounted_and_the_status_says_mtls(kube: Kube) -> None:
    kube.create_es("secure", resources={"gpu": 0}, tls={"secretName": "secure-tls", "clientCASecretName": "ca"})
    deployment = valid(wait_for("deployment", lambda: kube.child(DEPLOYMENTS, "secure")))
    pod = deployment["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"tls": "secure-tls", "client-ca": "ca"}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["tls"]["readOnly"] and mounts["client-ca"]["readOnly"]
    variables = env_of(deployment)
    assert variables["KEMBED_TLS_CERT_FILE"] == f"{mounts['tls']['mountPath']}/tls.crt"
    assert variables["KEMBED_TLS_KEY_FILE"] == f"{mounts['tls']['mountPath']}/tls.key"
    assert variables["KEMBED_TLS_CLIENT_CA_FILE"] == f"{mounts['client-ca']['mountPath']}/ca.crt"
    status = wait_for("status", lambda: kube.es("secure").get("status", {}).get("transport"))
    assert status == "mtls"
    assert kube.es("secure")["status"]["endpoint"] == "dns:///secure.default.svc.cluster.local:50051"


def test_the_network_policy_is_created_repaired_and_removed(kube: Kube, emulator: EmulatorThread) -> None:
    uid = kube.create_es("fenced", resources={"gpu": 0}, networkPolicy={"metricsFrom": [{"podSelector": {}}]})
    policy = valid(wait_for("policy", lambda: kube.child(POLICIES, "fenced")))
    (ref,) = policy["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["controller"]) == (uid, True)
    assert [rule["ports"][0]["port"] for rule in policy["spec"]["ingress"]] == [50051, 8001]
    assert wait_for("plaintext status", lambda: kube.es("fenced").get("status", {}).get("transport")) == "plaintext"

    kube.patch_child(POLICIES, "fenced", {"spec": {"ingress": [{}]}})  # a hand edit that admits everyone
    wait_for("the policy repaired", lambda: len((kube.child(POLICIES, "fenced") or {})["spec"]["ingress"]) == 2)
    kube.delete_child(POLICIES, "fenced")
    wait_for("the policy restored", lambda: kube.child(POLICIES, "fenced"))

    kube.patch_es("fenced", {"networkPolicy": {"enabled": False}})
    wait_for("the policy removed", lambda: kube.child(POLICIES, "fenced") is None)
    # RBAC grew by what this uses: the verbs every child kind is granted, all called here but `get`,
    # which a reconcile uses only after a failure or on its periodic resync (it reads kopf's index).
    assert _operator_verbs(emulator, "networkpolicies") == {"list", "watch", "create", "patch", "delete"}


def test_an_autoscaler_whose_metrics_nothing_may_scrape_is_reported(kube: Kube) -> None:
    """No metricsFrom, and no default from the operator (the chart's metricsFrom is empty)."""
    kube.create_es("starved", maxReplicas=3, resources={"gpu": 0})
    blocked = wait_for("MetricsAdmitted", lambda: condition(kube.es("starved"), "MetricsAdmitted"))
    assert (blocked["status"], blocked["reason"]) == ("False", "NoMetricsPeers")
    assert "autoscaler" in blocked["message"] and "metricsFrom" in blocked["message"]
    wait_for("a Warning event", lambda: ("Warning", "NoMetricsPeers") in kube.events("starved"))
    kube.patch_es("starved", {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {}}]}})
    wait_for("admitted", lambda: condition(kube.es("starved"), "MetricsAdmitted").get("status") == "True")


def _operator_verbs(emulator: EmulatorThread, plural: str) -> set[str]:
    return {verb for _, resource, verb in operator_calls(emulator.requests()) if resource == plural}
