"""End to end: EmbeddingJobs through a real `kopf run` of the operator against the emulated API server.

The emulator has no controllers: the tests play the Deployment controller (the service becomes
Ready), the Job controller (pods with their index, owner and termination message; the Job's
status) and the kubelet (pod phases). Nor has it a garbage collector: what deletion proves here is
that the Job is owned by its EmbeddingJob and that the operator deletes it, with its pods, itself.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from kubernetes import client

from kembed.contract import GRPC_PORT
from kembed_operator import identity, job_render, permissions
from kembed_operator.config import OperatorConfig
from tests.operator.cluster import DEPLOYMENTS, JOBS, PODS, Kube, condition, operator_calls, operator_requests
from tests.operator.conftest import wait_for
from tests.operator.emulator import EmulatorThread

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:07:00Z"


@pytest.fixture(scope="module")
def kube(api: client.ApiClient, operator_process: subprocess.Popen[bytes]) -> Kube:
    return Kube(api)


def corpus(service: str, shards: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "service": service,
        "input": {"claimName": "corpora", "path": "wiki/texts.txt"},
        "output": {"claimName": "vectors", "path": "wiki/emb.npy"},
        "shards": shards,
        **extra,
    }


def progressing(kube: Kube, name: str) -> dict[str, Any]:
    return condition(kube.ej(name), "Progressing")


def ready_service(kube: Kube, name: str) -> None:
    kube.create_es(name, resources={"gpu": 0})
    wait_for("the service's Deployment", lambda: kube.child(DEPLOYMENTS, name))
    kube.roll_out()
    wait_for("the service Ready", lambda: condition(kube.es(name), "Ready").get("status") == "True")


def play_pod(
    kube: Kube, job: dict[str, Any], index: int, attempt: int, phase: str, rows: int = 0, code: int = 1, error: str = ""
) -> None:
    """A pod of ``job`` for shard ``index``, as the Job controller makes it and the kubelet ends it
    (with exit ``code`` and the command's ``error`` in its summary when it failed)."""
    name = f"{job['metadata']['name']}-{index}-{attempt}"
    template = job["spec"]["template"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"], "uid": job["metadata"]["uid"]}
    kube.create_child(
        PODS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": template["metadata"]["labels"],
                "annotations": {job_render.INDEX_ANNOTATION: str(index)},
                "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": template["spec"],
        },
    )
    summary = {"rows": rows, "embedded": rows, "shard": f"{index}/3", "output": "o", "complete": phase == "Succeeded"}
    state: dict[str, Any] = {"running": {"startedAt": T0}}
    if phase != "Running":
        exit_code = 0 if phase == "Succeeded" else code
        message = json.dumps({**summary, "error": error or None})
        state = {"terminated": {"exitCode": exit_code, "message": message, "finishedAt": T1}}
    status = {"phase": phase, "containerStatuses": [{"name": job_render.CONTAINER, "state": state}]}
    kube.patch_child(PODS, name, {"status": status}, "status")


def test_a_job_waits_for_its_service_then_becomes_one_indexed_job(kube: Kube) -> None:
    uid = kube.create_ej("wiki", **corpus("bge"))
    wait_for("ServiceNotFound", lambda: progressing(kube, "wiki").get("reason") == "ServiceNotFound")
    kube.create_es("bge", resources={"gpu": 0})
    wait_for("ServiceNotReady", lambda: progressing(kube, "wiki").get("reason") == "ServiceNotReady")
    assert kube.child(JOBS, "wiki") is None
    kube.roll_out()  # the service's pods pass their readiness probes
    job = wait_for("the Job", lambda: kube.child(JOBS, "wiki"))

    (ref,) = job["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (identity.JOB_KIND, "wiki", uid, True)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == OperatorConfig().default_image  # the service's image: the chart's server image
    assert container["command"] == ["python", "-m", "kembed.client", "embed"]
    args = container["args"]
    assert args[args.index("--target") + 1] == f"bge.default.svc.cluster.local:{GRPC_PORT}"
    assert args[args.index("--shard") + 1] == "$(JOB_COMPLETION_INDEX)/3"
    assert args[args.index("--summary-file") + 1] == "/dev/termination-log"
    variables = {e["name"]: e for e in container["env"]}
    assert variables["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"].endswith(
        f"['{job_render.INDEX_ANNOTATION}']"
    )
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"corpora", "vectors"}
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/data/corpora", "/data/vectors"}

    ej = wait_for("Progressing", lambda: progressing(kube, "wiki").get("status") == "True" and kube.ej("wiki"))
    assert (ej["status"]["progress"], ej["status"]["observedGeneration"]) == ("0/3", 1)
    wait_for("a Created event", lambda: ("Normal", "Created") in kube.events("wiki"))


def test_the_status_follows_the_job_and_its_pods(kube: Kube) -> None:
    ready_service(kube, "minilm")
    kube.create_ej("books", **corpus("minilm"))
    job = wait_for("the Job", lambda: kube.child(JOBS, "books"))
    play_pod(kube, job, 0, 0, "Succeeded", rows=5)
    play_pod(kube, job, 1, 0, "Failed", rows=2)  # committed 2 rows, then died...
    play_pod(kube, job, 1, 1, "Succeeded", rows=6)  # ...and its retry finished the part
    play_pod(kube, job, 2, 0, "Running")
    running = {"active": 1, "succeeded": 2, "failed": 1, "completedIndexes": "0,1", "startTime": T0}
    kube.patch_child(JOBS, "books", {"status": running}, "status")
    ej = wait_for("two shards done", lambda: (e := kube.ej("books")).get("status", {}).get("progress") == "2/3" and e)
    status = ej["status"]
    assert (status["shardsSucceeded"], status["shardsRunning"], status["podFailures"]) == (2, 1, 1)
    assert (status["rowsWritten"], status["startTime"]) == (11, T0)

    play_pod(kube, job, 2, 1, "Succeeded", rows=7)
    complete = {"type": "Complete", "status": "True", "reason": "CompletionsReached", "message": "done"}
    done = {"active": 0, "succeeded": 3, "completedIndexes": "0-2", "completionTime": T1, "conditions": [complete]}
    kube.patch_child(JOBS, "books", {"status": done}, "status")
    ej = wait_for("Complete", lambda: condition(e := kube.ej("books"), "Complete").get("status") == "True" and e)
    assert (ej["status"]["rowsWritten"], ej["status"]["completionTime"]) == (18, T1)
    assert ej["status"]["manifest"] == "wiki/emb.manifest.json"
    assert (progressing(kube, "books")["status"], progressing(kube, "books")["reason"]) == ("False", "Complete")


def test_a_failed_shard_fails_the_job(kube: Kube) -> None:
    ready_service(kube, "e5")
    kube.create_ej("broken", **corpus("e5", shards=2))
    job = wait_for("the Job", lambda: kube.child(JOBS, "broken"))
    play_pod(kube, job, 0, 0, "Succeeded", rows=3)
    why = "input line 2: not UTF-8 (byte 5: invalid start byte)"
    play_pod(kube, job, 1, 0, "Failed", rows=1, code=3, error=why)  # a bad line: no retry can fix it
    failed = {"type": "Failed", "status": "True", "reason": "FailedIndexes", "message": "Job has failed indexes"}
    status = {"succeeded": 1, "failed": 1, "completedIndexes": "0", "failedIndexes": "1", "conditions": [failed]}
    kube.patch_child(JOBS, "broken", {"status": status}, "status")
    ej = wait_for("Failed", lambda: condition(e := kube.ej("broken"), "Failed").get("status") == "True" and e)
    assert condition(ej, "Failed")["message"].startswith(f"shards that failed for good: 1; shard 1: {why}")
    assert (ej["status"]["shardsFailed"], ej["status"]["rowsWritten"]) == (1, 4)
    assert ej["status"]["failedShards"] == [{"shard": 1, "exitCode": 3, "message": why}]


def test_deleting_the_embedding_job_deletes_its_job(kube: Kube, emulator: EmulatorThread) -> None:
    ready_service(kube, "gte")
    uid = kube.create_ej("doomed", **corpus("gte"))
    job = wait_for("the Job", lambda: kube.child(JOBS, "doomed"))
    (ref,) = job["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["blockOwnerDeletion"]) == (uid, True)  # a cluster's collector would take it too
    play_pod(kube, job, 0, 0, "Running")
    kube.delete_ej("doomed")
    wait_for("the Job gone", lambda: kube.child(JOBS, "doomed") is None)
    wait_for("the EmbeddingJob gone", lambda: "doomed" not in {e["metadata"]["name"] for e in kube.all_ej()})
    deletes = [
        r
        for r in operator_requests(emulator.requests())
        if r.resource is not None and r.resource.plural == "jobs" and r.action is not None and r.action.name == "DELETE"
    ]
    # Background: the Job's pods go too (the API's default for a Job would orphan them).
    assert [(r.name, r.params.get("propagationPolicy")) for r in deletes] == [("doomed", "Background")]


def test_what_the_operator_does_not_allow_is_not_run(kube: Kube) -> None:
    ready_service(kube, "jina")
    kube.create_ej("rogue", **corpus("jina", env=[{"name": "LD_PRELOAD", "value": "/data/corpora/x.so"}]))
    wait_for("EnvNotAllowed", lambda: progressing(kube, "rogue").get("reason") == "EnvNotAllowed")
    assert "spec.env[0]: LD_PRELOAD" in progressing(kube, "rogue")["message"]
    wait_for("a Warning event", lambda: ("Warning", "EnvNotAllowed") in kube.events("rogue"))
    assert kube.child(JOBS, "rogue") is None


def test_every_call_is_granted_by_the_rbac_list(kube: Kube, emulator: EmulatorThread) -> None:
    """Run after the others in this module: every request the operator made is in the RBAC list, and
    it watched pods and Jobs with a label selector (the API server sends it its own only)."""
    watched = {
        request.resource.plural: request.params.get("labelSelector")
        for request in operator_requests(emulator.requests())
        if request.resource is not None and request.action is not None and request.action.name == "WATCH"
    }
    ours = f"{identity.LABEL_COMPONENT}=embedding-job,{identity.LABEL_MANAGED_BY}={identity.MANAGED_BY}"
    assert watched["pods"] == watched["jobs"] == ours
    assert watched["deployments"] == f"{identity.LABEL_MANAGED_BY}={identity.MANAGED_BY}"
    calls = set(operator_calls(emulator.requests()))
    assert calls <= permissions.triples(), calls - permissions.triples()
    exercised = {
        ("batch", "jobs", "create"),
        ("batch", "jobs", "delete"),
        ("", "pods", "watch"),
        ("kembed.io", "embeddingjobs/status", "patch"),
    }
    assert exercised <= calls
