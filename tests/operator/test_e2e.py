"""End to end: a real `kopf run` of the operator against the emulated API server over loopback.

The emulator has no controllers: Deployments get a status only when a test writes one, nothing is
garbage-collected, and no admission or schema validation happens (docs/operator.md lists what this
cannot prove). Each test uses its own EmbeddingService, so they do not depend on each other's order.
"""

from __future__ import annotations

import functools
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kembed_operator import identity, permissions
from kembed_operator.config import OperatorConfig
from tests.operator.cluster import (
    DEPLOYMENTS,
    HPAS,
    PDBS,
    SCALED_OBJECTS,
    SERVICES,
    Kube,
    condition,
    operator_calls,
    operator_writes,
)
from tests.operator.conftest import PROMETHEUS_URL, wait_for
from tests.operator.emulator import EmulatorThread
from tests.operator.test_slo_status import CONDITION_TYPES

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def kube(api: client.ApiClient, operator_process: subprocess.Popen[bytes]) -> Kube:
    return Kube(api)


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_children_appear_with_owner_references(kube: Kube) -> None:
    uid = kube.create_es("alpha", maxReplicas=3, resources={"gpu": 0})
    for plural in (DEPLOYMENTS, SERVICES, PDBS, HPAS):
        child = wait_for(plural, functools.partial(kube.child, plural, "alpha"))
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["kind"], ref["controller"]) == (uid, identity.KIND, True)
        assert child["metadata"]["labels"][identity.LABEL_MANAGED_BY] == identity.MANAGED_BY
    es = wait_for("status", lambda: kube.es("alpha").get("status", {}).get("conditions") and kube.es("alpha"))
    status = es["status"]
    assert status["observedGeneration"] == es["metadata"]["generation"] == 1
    assert status["endpoint"] == "dns:///alpha.default.svc.cluster.local:50051"
    assert status["selector"] == "app.kubernetes.io/instance=alpha,app.kubernetes.io/name=kembed"
    assert condition(es, "Progressing")["status"] == "True"  # no controller has rolled anything out
    assert condition(es, "Ready")["status"] == "False"
    assert [c["type"] for c in status["conditions"]] == list(CONDITION_TYPES)
    wait_for("a Created event", lambda: ("Normal", "Created") in kube.events("alpha"))


def test_status_follows_the_deployment(kube: Kube) -> None:
    kube.create_es("follow", resources={"gpu": 0})
    deployment = wait_for("deployment", lambda: kube.child(DEPLOYMENTS, "follow"))
    rolled_out = {"observedGeneration": deployment["metadata"]["generation"], "replicas": 1}
    rolled_out |= {"updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}
    kube.patch_child(DEPLOYMENTS, "follow", {"status": rolled_out}, "status")
    es = wait_for("Ready", lambda: condition(kube.es("follow"), "Ready").get("status") == "True" and kube.es("follow"))
    assert es["status"]["readyReplicas"] == es["status"]["replicas"] == 1
    assert condition(es, "Available")["status"] == "True"
    assert condition(es, "Progressing")["status"] == "False"
    assert condition(es, "Degraded")["status"] == "False"


def test_spec_change_rolls_out(kube: Kube) -> None:
    kube.create_es("change", maxReplicas=2, resources={"gpu": 0})
    wait_for("deployment", lambda: kube.child(DEPLOYMENTS, "change"))
    kube.patch_es("change", {"slo": {"p95LatencyMs": 400}})
    deployment = wait_for(
        "the new thresholds",
        lambda: env_of(d := kube.child(DEPLOYMENTS, "change") or {}).get("KEMBED_P95_SOFT_MS") == "400" and d,
    )
    assert env_of(deployment)["KEMBED_P95_HARD_MS"] == "800"
    hpa = wait_for(
        "the new HPA targets",
        lambda: (
            (h := kube.child(HPAS, "change"))
            and h["spec"]["metrics"][1]["pods"]["target"]["averageValue"] == "160m"  # the drain guard, 0.4 P
            and h
        ),
    )
    assert hpa["spec"]["maxReplicas"] == 2
    wait_for("observedGeneration 2", lambda: kube.es("change").get("status", {}).get("observedGeneration") == 2)


def test_autoscaler_owned_replicas_are_left_alone(kube: Kube) -> None:
    kube.create_es("scaled", minReplicas=1, maxReplicas=5, resources={"gpu": 0})
    wait_for("deployment", lambda: kube.child(DEPLOYMENTS, "scaled"))
    kube.patch_child(DEPLOYMENTS, "scaled", {"spec": {"replicas": 4}})  # what an HPA does
    kube.patch_es("scaled", {"nodeSelector": {"pool": "search"}})
    deployment = wait_for(
        "the new node selector",
        lambda: (d := kube.child(DEPLOYMENTS, "scaled")) and d["spec"]["template"]["spec"].get("nodeSelector") and d,
    )
    assert deployment["spec"]["replicas"] == 4


def test_deleted_children_are_restored(kube: Kube) -> None:
    kube.create_es("restore", maxReplicas=2, resources={"gpu": 0})
    for plural in (SERVICES, HPAS, DEPLOYMENTS):
        old = wait_for(plural, functools.partial(kube.child, plural, "restore"))
        kube.delete_child(plural, "restore")
        new = wait_for(f"{plural} restored", functools.partial(kube.child, plural, "restore"))
        assert new["metadata"]["uid"] != old["metadata"]["uid"]


def test_hand_edits_are_reverted(kube: Kube) -> None:
    kube.create_es("edited", resources={"gpu": 0})  # the operator's image: the chart allows no other
    wait_for("deployment", lambda: kube.child(DEPLOYMENTS, "edited"))
    kube.patch_child(
        DEPLOYMENTS, "edited", {"spec": {"template": {"spec": {"containers": [{"name": "server", "image": "evil:1"}]}}}}
    )
    wait_for(
        "the image restored",
        lambda: (
            (d := kube.child(DEPLOYMENTS, "edited"))
            and d["spec"]["template"]["spec"]["containers"][0]["image"] == OperatorConfig().default_image
        ),
    )
    kube.patch_child(SERVICES, "edited", {"spec": {"selector": {identity.LABEL_INSTANCE: "other"}}})
    wait_for(
        "the selector restored",
        lambda: (s := kube.child(SERVICES, "edited")) and s["spec"]["selector"][identity.LABEL_INSTANCE] == "edited",
    )


def test_invalid_spec_degrades_without_crashing(kube: Kube, operator_process: subprocess.Popen[bytes]) -> None:
    # Valid for the schema, but the derived hard limit (2 x 1000 ms) is below the explicit soft one.
    kube.create_es("broken", admission={"p95SoftMs": 5000}, resources={"gpu": 0})
    es = wait_for(
        "Degraded", lambda: condition(kube.es("broken"), "Degraded").get("status") == "True" and kube.es("broken")
    )
    degraded = condition(es, "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "KEMBED_P95_SOFT_MS" in degraded["message"]
    assert condition(es, "Ready")["status"] == "False"
    assert es["status"]["observedGeneration"] == 1
    assert kube.child(DEPLOYMENTS, "broken") is None
    wait_for("a warning event", lambda: ("Warning", "InvalidSpec") in kube.events("broken"))
    assert operator_process.poll() is None

    kube.patch_es("broken", {"admission": {"p95HardMs": 6000}})
    wait_for("Degraded cleared", lambda: condition(kube.es("broken"), "Degraded").get("status") == "False")
    assert kube.child(DEPLOYMENTS, "broken") is not None


def test_a_quantity_kubernetes_would_refuse_degrades(kube: Kube, operator_process: subprocess.Popen[bytes]) -> None:
    """Python parses "Infinity"; the reconcile once raised on it and retried for ever, with no status.
    The emulator checks no schema, like an older CRD: the operator refuses it itself."""
    kube.create_es("infinite", resources={"gpu": 0, "cpu": "Infinity"})
    es = wait_for(
        "Degraded", lambda: condition(kube.es("infinite"), "Degraded").get("status") == "True" and kube.es("infinite")
    )
    degraded = condition(es, "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "spec.resources.cpu: 'Infinity'" in degraded["message"]
    assert kube.child(DEPLOYMENTS, "infinite") is None
    wait_for("a warning event", lambda: ("Warning", "InvalidSpec") in kube.events("infinite"))

    # Past the schema's replica ceiling: the same answer, for the new field.
    kube.patch_es("infinite", {"resources": {"cpu": "2"}, "maxReplicas": 2_000_000_000})
    wait_for("maxReplicas named", lambda: "spec.maxReplicas" in condition(kube.es("infinite"), "Degraded")["message"])
    assert condition(kube.es("infinite"), "Degraded")["reason"] == "InvalidSpec"
    assert kube.child(DEPLOYMENTS, "infinite") is None

    kube.patch_es("infinite", {"maxReplicas": 2})
    wait_for("Degraded cleared", lambda: condition(kube.es("infinite"), "Degraded").get("status") == "False")
    assert kube.child(DEPLOYMENTS, "infinite") is not None
    assert operator_process.poll() is None


def test_switching_autoscaler_replaces_the_child(kube: Kube) -> None:
    kube.create_es("switch", maxReplicas=3, resources={"gpu": 0})
    wait_for("HPA", lambda: kube.child(HPAS, "switch"))
    kube.patch_es("switch", {"autoscaling": {"provider": "keda"}})
    scaled = wait_for("ScaledObject", lambda: kube.child(SCALED_OBJECTS, "switch"))
    triggers = scaled["spec"]["triggers"]  # the demand, and the drain time and the P95 as guards
    assert [t["metadata"]["serverAddress"] for t in triggers] == [PROMETHEUS_URL] * 3
    assert "kembed_demand_ratio" in triggers[0]["metadata"]["query"]
    wait_for("HPA removed", lambda: kube.child(HPAS, "switch") is None)
    kube.patch_es("switch", {"autoscaling": {"enabled": False}, "minReplicas": 2})
    wait_for("ScaledObject removed", lambda: kube.child(SCALED_OBJECTS, "switch") is None)
    wait_for("fixed replicas", lambda: (kube.child(DEPLOYMENTS, "switch") or {}).get("spec", {}).get("replicas") == 2)


def test_service_type_switch_recreates_the_service(kube: Kube) -> None:
    kube.create_es("flip", resources={"gpu": 0})
    old = wait_for("service", lambda: kube.child(SERVICES, "flip"))
    assert old["spec"]["clusterIP"] != "None"  # the emulator assigns one and keeps it immutable
    kube.patch_es("flip", {"service": {"type": "Headless"}})
    new = wait_for(
        "a headless Service", lambda: (s := kube.child(SERVICES, "flip")) and s["spec"]["clusterIP"] == "None" and s
    )
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    wait_for("a Replaced event", lambda: ("Normal", "Replaced") in kube.events("flip"))
    kube.patch_es("flip", {"service": {"type": "ClusterIP"}})
    wait_for(
        "a ClusterIP Service again", lambda: (s := kube.child(SERVICES, "flip")) and s["spec"]["clusterIP"] != "None"
    )
    assert condition(kube.es("flip"), "Degraded")["status"] == "False"


def test_every_call_is_granted_by_the_rbac_list(kube: Kube, emulator: EmulatorThread) -> None:
    """The emulator saw every request the operator (kopf included) made: each must be in RULES."""
    kube.create_es("audit", maxReplicas=2, resources={"gpu": 0})  # exercise create, status and delete
    wait_for("HPA", lambda: kube.child(HPAS, "audit"))
    kube.patch_es("audit", {"autoscaling": {"enabled": False}})
    wait_for("HPA removed", lambda: kube.child(HPAS, "audit") is None)
    wait_for("a Deleted event", lambda: ("Normal", "Deleted") in kube.events("audit"))
    calls = set(operator_calls(emulator.requests()))
    assert calls, "the operator made no calls"
    assert calls <= permissions.triples(), calls - permissions.triples()
    # The operator's core work was exercised, so the comparison means something.
    exercised = {
        ("apps", "deployments", "create"),
        ("autoscaling", "horizontalpodautoscalers", "delete"),
        ("", "events", "create"),
    }
    exercised |= {("kembed.io", "embeddingservices/status", "patch"), ("kopf.dev", "clusterkopfpeerings", "patch")}
    assert exercised <= calls


def test_deleting_a_resource_waits_only_for_its_loop_to_stop(kube: Kube) -> None:
    """The reconcile loop's finalizer: on, while the resource lives; released when it goes."""
    kube.create_es("doomed", resources={"gpu": 0})
    wait_for("the finalizer", lambda: kube.es("doomed")["metadata"].get("finalizers"))
    kube.delete_es("doomed")
    wait_for("the resource gone", lambda: "doomed" not in {es["metadata"]["name"] for es in kube.all_es()})


# At rest, the operator writes only when something wakes its loop for a resource (handlers.py):
# an echo of its own writes (SETTLE_S and one reconcile apart: "at rest" below is 3 s without a
# write), a failing reconcile's retry (backed off 1 to 30 s apart, each one logged at once), or the
# resync (RESYNC_S, 600 s). The window is two of "at rest"'s: an echo slowed by a busy machine shows.
AT_REST_S = 3.0
QUIET_S = 2 * AT_REST_S


def _writes_over(emulator: EmulatorThread, seconds: float) -> list[tuple[str, str, str]]:
    """The operator's writes (leader election's keepalive aside) during the next ``seconds``."""
    mark = len(emulator.requests())
    time.sleep(seconds)
    return operator_writes(emulator.requests()[mark:])


def _selected(service: dict[str, Any] | None) -> str:
    return str((service or {}).get("spec", {}).get("selector", {}).get(identity.LABEL_INSTANCE))


def test_quiet_at_rest_and_reads_per_reconcile(
    kube: Kube, emulator: EmulatorThread, operator_process: subprocess.Popen[bytes]
) -> None:
    # 4000m comes back as 4 (the emulator stores CPU canonically, as the API server does).
    kube.create_es("quiet", maxReplicas=2, resources={"gpu": 0, "cpu": "4000m"})
    wait_for("children", lambda: kube.child(HPAS, "quiet"))
    kube.roll_out()
    wait_for("Ready", lambda: condition(kube.es("quiet"), "Ready").get("status") == "True")
    wait_for("every resource at rest", lambda: _writes_over(emulator, AT_REST_S) == [], timeout=60)
    assert _writes_over(emulator, QUIET_S) == []
    log = Path(f"/proc/{operator_process.pid}/fd/1").read_text(errors="replace")  # kopf's, as it runs
    about = [line for line in log.splitlines() if "/quiet]" in line]  # kopf prefixes each resource's lines
    assert about and [line for line in about if "reconcile failed" in line] == []

    # One drifted child: the repair is one apply, and the reconciles it takes read nothing by GET
    # (kopf's indexes, fed by the watches, are what they read).
    mark = len(emulator.requests())
    kube.patch_child(SERVICES, "quiet", {"spec": {"selector": {identity.LABEL_INSTANCE: "other"}}})
    wait_for("the selector restored", lambda: _selected(kube.child(SERVICES, "quiet")) == "quiet")
    time.sleep(2)  # the echoes of the repair: more reconciles, no more writes
    requests = emulator.requests()[mark:]
    assert sorted(operator_writes(requests)) == [("", "events", "create"), ("", "services", "patch")]  # apply, Event
    assert [call for call in operator_calls(requests) if call[2] == "get"] == []


def test_operator_health_endpoint(kube: Kube, health_url: str) -> None:
    wait_for("the operator's liveness endpoint", lambda: _answers_200(health_url))


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # not listening yet
        return False
