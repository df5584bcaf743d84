"""The operator on a bad day: real `kopf run` processes against the fault-injecting emulator.

30% of the operator's writes fail (409, 500, 503, 429 with Retry-After), answers are slow, watches
end every few seconds and resumed watches expire (410 Gone, so kopf re-lists). Also a deletion in a
watch gap, SIGKILL in the middle of a reconcile, and two replicas with peering. The tests' own calls
are never faulted.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.operator import cluster
from tests.operator.cluster import DEPLOYMENTS, HPAS, PDBS, SCALED_OBJECTS, SERVICES, Kube, condition
from tests.operator.conftest import PROMETHEUS_URL, RESOURCES, start_operator, stop, wait_for
from tests.operator.emulator import EmulatorThread
from tests.operator.faults import Faults, FaultyEmulator

pytestmark = pytest.mark.timeout(300)
CHILD_PLURALS = (DEPLOYMENTS, SERVICES, PDBS, HPAS, SCALED_OBJECTS)
BAD_DAY = Faults(write_share=0.3, lost_answer_share=0.1, delay_s=0.02, watch_lifetime_s=4.0, gone_share=0.3)
# Watches cut every 2-4 s and half of them expired (kopf watches from the resourceVersion of its
# list too, so a share of 1 would expire every watch for good), writes healthy.
RELISTING = Faults(watch_lifetime_s=BAD_DAY.watch_lifetime_s, gone_share=0.5)
AT_REST_RELISTS = 40  # the window at rest, counted in the operator's re-lists instead of seconds
SETTLED_RELISTS = 10  # a window with no write: at rest
FRESH = 12  # resources created at once under the faults (12 did not converge in 150 s before)
CONVERGE_TIMEOUT_S = 180.0  # a hang guard: the time it took (about 10 s here) is printed, not asserted
PEERING_LIFETIME_S = 6  # a dead leader's lease lapses this fast here (60 s by default)
QUICK_AUDIT = "tests.operator.quick_audit"  # where a test waits for the periodic audit: every 5 s, not 30

StartOperator = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    with EmulatorThread(RESOURCES, factory=FaultyEmulator) as thread:
        yield thread


@pytest.fixture(scope="module")
def faulty(emulator: EmulatorThread) -> FaultyEmulator:
    assert isinstance(emulator.emulator, FaultyEmulator)
    return emulator.emulator


@pytest.fixture
def kube(api: client.ApiClient, peering: str, faulty: FaultyEmulator) -> Iterator[Kube]:
    yield Kube(api)
    faulty.faults = Faults()


@pytest.fixture
def operators(kubeconfig: Path, tmp_path: Path) -> Iterator[StartOperator]:
    """Starts operators (each with its own log, returned as ``process.log``); kills them all at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(label: str = "kopf", *modules: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{label}.log"
        process = start_operator(
            kubeconfig,
            log,
            env={"KEMBED_OPERATOR_PEERING_LIFETIME_S": str(PEERING_LIFETIME_S)},
            values={"kedaServerAddress": PROMETHEUS_URL},  # KEDA's Prometheus: the administrator's choice
            modules=modules,
        )
        process.log = log  # type: ignore[attr-defined]
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            stop(process)
    print(f"kopf logs: {tmp_path}")


def converged(kube: Kube, name: str, expected: set[str]) -> bool:
    """Exactly the expected children (each owned by the resource), status Ready and current."""
    kube.roll_out()
    es = kube.es(name)
    present = {plural for plural in CHILD_PLURALS if kube.child(plural, name) is not None}
    ready = condition(es, "Ready").get("status") == "True" and condition(es, "Degraded").get("status") == "False"
    current = es.get("status", {}).get("observedGeneration") == es["metadata"]["generation"]
    return present == expected and ready and current


def assert_no_strays(kube: Kube) -> None:
    """Every child is named after, and owned by, an existing EmbeddingService: nothing else exists."""
    uids = {es["metadata"]["name"]: es["metadata"]["uid"] for es in kube.all_es()}
    for plural in CHILD_PLURALS:
        for child in kube.children(plural):
            meta = child["metadata"]
            owners = [ref["uid"] for ref in meta.get("ownerReferences", [])]
            assert owners == [uids.get(meta["name"])], f"stray {plural}/{meta['name']}"


def watch_status(kube: Kube, names: list[str], seen: dict[str, set[str]]) -> None:
    """Record every Degraded reason shown, and check the status never claims more than is true."""
    for name in names:
        es = kube.es(name)
        degraded = condition(es, "Degraded")
        if degraded.get("status") == "True":
            seen[name].add(degraded["reason"])
        if condition(es, "Ready").get("status") == "True":
            assert degraded.get("status") == "False", (name, es["status"])
            assert kube.child(DEPLOYMENTS, name) is not None, name


def write_errors(injected: collections.Counter[str]) -> int:
    return sum(injected[str(status)] for status in BAD_DAY.statuses)


def survived(injected: collections.Counter[str]) -> bool:
    """Whether the faults the bad day's test claims to survive have all happened."""
    return (
        write_errors(injected) >= 20
        and injected["watch ended"] >= 3
        and min(injected["410"], injected["lost answer"]) >= 1
    )


def watch_until(what: str, done: Callable[[], bool], kube: Kube, names: list[str], seen: dict[str, set[str]]) -> None:
    """Check every status shown (:func:`watch_status`) until ``done``."""

    def probe() -> bool:
        watch_status(kube, names, seen)
        return done()

    wait_for(what, probe, timeout=CONVERGE_TIMEOUT_S, interval=0.3)


WITH_HPA = {DEPLOYMENTS, SERVICES, PDBS, HPAS}
FIXED = {DEPLOYMENTS, SERVICES, PDBS}


@pytest.mark.process
def test_converges_through_write_errors_and_dropped_watches(
    kube: Kube, emulator: EmulatorThread, faulty: FaultyEmulator, operators: StartOperator
) -> None:
    operators()
    kube.create_es("steady", maxReplicas=2, resources={"gpu": 0})
    kube.create_es("victim", maxReplicas=2, resources={"gpu": 0})
    for name in ("steady", "victim"):
        wait_for(f"{name} converged", lambda name=name: converged(kube, name, WITH_HPA))  # type: ignore[misc]

    faulty.faults, before = BAD_DAY, collections.Counter(faulty.injected)
    fresh = [f"fresh-{index:02d}" for index in range(FRESH)]
    for name in fresh:  # new services, created at once
        kube.create_es(name, maxReplicas=3, resources={"gpu": 0})
    kube.patch_es("steady", {"autoscaling": {"enabled": False}, "minReplicas": 2})  # a spec change
    kube.delete_child(SERVICES, "victim")  # deleted children
    kube.delete_child(HPAS, "victim")
    kube.create_es("bad", admission={"p95SoftMs": 5000}, resources={"gpu": 0})  # a bad spec
    names = [*fresh, "steady", "victim", "bad"]
    seen: dict[str, set[str]] = collections.defaultdict(set)
    shown = lambda: survived(faulty.injected - before) and "InvalidSpec" in seen["bad"]  # noqa: E731
    watch_until("the faults, and the bad spec said", shown, kube, names, seen)
    kube.patch_es("bad", {"admission": {"p95HardMs": 6000}})  # fixed while the faults go on
    fixed = kube.es("bad")["metadata"]["generation"]
    observed = lambda: kube.es("bad").get("status", {}).get("observedGeneration") == fixed  # noqa: E731
    watch_until("the fix seen through the faults", observed, kube, names, seen)

    injected = faulty.injected - before
    faulty.faults = Faults()
    stopped = time.monotonic()
    expected = {**dict.fromkeys(fresh, WITH_HPA), "steady": FIXED, "victim": WITH_HPA, "bad": FIXED}
    for name, children in expected.items():
        wait_for(
            f"{name} converged",
            lambda name=name, children=children: converged(kube, name, children),  # type: ignore[misc]
            timeout=CONVERGE_TIMEOUT_S - (time.monotonic() - stopped),
        )
    print(f"converged {time.monotonic() - stopped:.1f} s after the faults stopped; injected {dict(injected)}")
    print(f"Degraded reasons shown during the faults: { {name: sorted(r) for name, r in seen.items()} }")
    assert_no_strays(kube)
    assert "InvalidSpec" in seen["bad"]
    assert kube.child(DEPLOYMENTS, "steady")["spec"]["replicas"] == 2  # type: ignore[index]
    # The faults this claims to survive did happen.
    assert survived(injected), injected
    # Then at rest, the watches still expiring: what the faults left in kopf's indexes writes nothing.
    faulty.faults = RELISTING
    assert_quiet_while_relisting(emulator, faulty)


def one_converged(kube: Kube, operators: StartOperator, name: str) -> None:
    """An operator running and one fixed-size resource converged under it."""
    operators()
    kube.create_es(name, resources={"gpu": 0})
    wait_for(f"{name} converged", lambda: converged(kube, name, FIXED))


@pytest.mark.process
def test_a_failed_repair_is_retried_without_another_event(
    kube: Kube, faulty: FaultyEmulator, operators: StartOperator
) -> None:
    one_converged(kube, operators, "lonely")
    faulty.faults = Faults(write_share=1.0)  # every write fails; no watch is disturbed
    before = write_errors(faulty.injected)
    kube.delete_child(SERVICES, "lonely")  # the last event there will be
    wait_for("the repair to fail twice", lambda: write_errors(faulty.injected) >= before + 2)
    faulty.faults = Faults()
    wait_for("the Service back, on the retry timer", lambda: kube.child(SERVICES, "lonely"), timeout=CONVERGE_TIMEOUT_S)


WITH_KEDA = {DEPLOYMENTS, SERVICES, PDBS, SCALED_OBJECTS}


def in_a_watch_gap(faulty: FaultyEmulator, plural: str, during: Faults, change: Callable[[], object]) -> None:
    """Make ``change`` while the operator's watches of ``plural`` are down (with the faults ``during``),
    then let them resume: each is answered 410 Gone, so kopf re-lists and hears nothing of what
    ``change`` deleted."""
    faulty.faults, held = dataclasses.replace(during, gap=(plural.split("/")[-1],)), faulty.injected["watch held"]
    # A new watch held means the one before it has ended: from here on, kopf hears nothing of the kind.
    wait_for(f"the watch of {plural} down", lambda: faulty.injected["watch held"] > held)
    change()
    expired, faulty.faults = faulty.injected["410"], during
    wait_for("the held watch expired (kopf re-lists)", lambda: faulty.injected["410"] > expired)


def delete_in_a_watch_gap(kube: Kube, faulty: FaultyEmulator, plural: str, name: str, during: Faults) -> str:
    """Delete a child by hand in a watch gap; returns its uid."""
    child = kube.child(plural, name)
    assert child is not None
    in_a_watch_gap(faulty, plural, during, lambda: kube.delete_child(plural, name))
    return str(child["metadata"]["uid"])


def made_again(kube: Kube, plural: str, name: str, uid: str) -> None:
    relisted = time.monotonic()
    wait_for(
        f"{plural}/{name} made again",
        lambda: (made := kube.child(plural, name)) and made["metadata"]["uid"] != uid,
        timeout=CONVERGE_TIMEOUT_S,  # a hang guard: before the audit, the resync 540-660 s later made it
    )
    print(f"{plural}/{name}, deleted in a watch gap, made again {time.monotonic() - relisted:.1f} s after the re-list")


def writes_over_relists(emulator: EmulatorThread, faulty: FaultyEmulator, relists: int) -> list[tuple[str, str, str]]:
    """The operator's writes (the leader election's keepalive aside) while its watches re-list ``relists`` times."""
    mark, expired = len(emulator.requests()), faulty.injected["410"]
    wait_for(f"{relists} re-lists", lambda: faulty.injected["410"] >= expired + relists)
    return cluster.operator_writes(emulator.requests()[mark:])


def assert_quiet_while_relisting(emulator: EmulatorThread, faulty: FaultyEmulator) -> None:
    """Under :data:`RELISTING`, once settled: every re-list wakes the loops and has the indexes
    audited against the API server, and none of it may write."""
    wait_for(
        "the operator at rest",
        lambda: writes_over_relists(emulator, faulty, SETTLED_RELISTS) == [],
        timeout=CONVERGE_TIMEOUT_S,
    )
    started, audited = time.monotonic(), audits(emulator)
    assert writes_over_relists(emulator, faulty, AT_REST_RELISTS) == []
    elapsed, lists = time.monotonic() - started, audits(emulator) - audited
    print(f"at rest: 0 writes over {AT_REST_RELISTS} re-lists ({elapsed:.1f} s, {lists} audit lists)")


def audits(emulator: EmulatorThread, plural: str = "") -> int:
    """The operator's audit lists (of ``plural``, else of every kind): kopf lists whole objects, the
    audit their metadata."""
    return sum(
        1
        for request in cluster.operator_requests(emulator.requests())
        if request.resource is not None
        and request.resource.plural == (plural.split("/")[-1] or request.resource.plural)
        and request.action is not None
        and request.action.name == "LIST"
        and "PartialObjectMetadataList" in request.headers.get("Accept", "")
    )


@pytest.mark.process
def test_a_child_deleted_in_a_watch_gap_comes_back_and_then_all_stays_quiet(
    kube: Kube, emulator: EmulatorThread, faulty: FaultyEmulator, operators: StartOperator
) -> None:
    """Issue 34's case: a Deployment deleted by hand in a gap of the Deployments' watch, under the bad
    day's faults. kopf's re-list finds the witness's Deployment, and asks for an audit by it."""
    operators()
    for name in ("gapped", "witness"):
        kube.create_es(name, resources={"gpu": 0})
        wait_for(f"{name} converged", lambda name=name: converged(kube, name, FIXED))  # type: ignore[misc]
    made_again(kube, DEPLOYMENTS, "gapped", delete_in_a_watch_gap(kube, faulty, DEPLOYMENTS, "gapped", BAD_DAY))

    faulty.faults = RELISTING
    wait_for("gapped converged", lambda: converged(kube, "gapped", FIXED), timeout=CONVERGE_TIMEOUT_S)
    assert_quiet_while_relisting(emulator, faulty)
    assert converged(kube, "gapped", FIXED) and converged(kube, "witness", FIXED)


@pytest.mark.process
def test_a_child_deleted_in_a_watch_gap_comes_back_after_an_empty_re_list(
    kube: Kube, emulator: EmulatorThread, faulty: FaultyEmulator, operators: StartOperator
) -> None:
    """The only ScaledObject deleted in the gap: the re-list finds none, so no event follows it at all."""
    operators("kopf", QUICK_AUDIT)
    keda = {"provider": "keda"}
    kube.create_es("lone", maxReplicas=2, resources={"gpu": 0}, autoscaling=keda)
    wait_for("lone converged", lambda: converged(kube, "lone", WITH_KEDA))
    assert [o["metadata"]["name"] for o in kube.children(SCALED_OBJECTS)] == ["lone"]
    # After a first audit of the ScaledObject, with no fault that makes kopf re-list: nothing but the
    # periodic audit, a period after that one, can find the deletion (the gap's own re-list finds nothing).
    wait_for("a first audit of the ScaledObject", lambda: audits(emulator, SCALED_OBJECTS) >= 1)
    made_again(kube, SCALED_OBJECTS, "lone", delete_in_a_watch_gap(kube, faulty, SCALED_OBJECTS, "lone", Faults()))


@pytest.mark.process
def test_what_the_operator_deleted_in_a_watch_gap_is_not_deleted_again(
    kube: Kube, emulator: EmulatorThread, faulty: FaultyEmulator, operators: StartOperator
) -> None:
    """The HPA deleted by the operator itself (autoscaling turned off) while the HPAs' watch is down:
    kopf's index keeps it, and every reconcile would delete it again (a 404) and post an Event."""
    operators()
    kube.create_es("shrunk", maxReplicas=2, resources={"gpu": 0})
    wait_for("shrunk converged", lambda: converged(kube, "shrunk", WITH_HPA))

    def turn_autoscaling_off() -> None:
        kube.patch_es("shrunk", {"autoscaling": {"enabled": False}})
        wait_for("the HPA deleted", lambda: kube.child(HPAS, "shrunk") is None)

    in_a_watch_gap(faulty, HPAS, RELISTING, turn_autoscaling_off)
    wait_for("shrunk converged", lambda: converged(kube, "shrunk", FIXED), timeout=CONVERGE_TIMEOUT_S)
    assert_quiet_while_relisting(emulator, faulty)


@pytest.mark.process
def test_status_says_degraded_while_children_cannot_be_written(
    kube: Kube, faulty: FaultyEmulator, operators: StartOperator
) -> None:
    one_converged(kube, operators, "honest")
    # Every write to a child fails; the status can still be written, so it must say so.
    faulty.faults = Faults(write_share=1.0, spared=("clusterkopfpeerings", "embeddingservices"))
    kube.patch_es("honest", {"nodeSelector": {"team": "search"}})
    es = wait_for("Degraded", lambda: condition(e := kube.es("honest"), "Degraded").get("status") == "True" and e)
    assert condition(es, "Degraded")["reason"] == "ApiUnavailable"
    assert (condition(es, "Ready")["status"], condition(es, "Ready")["reason"]) == ("False", "ApiUnavailable")
    faulty.faults = Faults()
    wait_for("honest converged again", lambda: converged(kube, "honest", FIXED), timeout=CONVERGE_TIMEOUT_S)
    template = kube.child(DEPLOYMENTS, "honest")["spec"]["template"]  # type: ignore[index]
    assert template["spec"]["nodeSelector"]["team"] == "search"


@pytest.mark.process
def test_sigkill_mid_reconcile_then_restart(kube: Kube, faulty: FaultyEmulator, operators: StartOperator) -> None:
    faulty.faults = Faults(delay_s=0.4)  # slow answers: the kill lands between two child writes
    first = operators("first")
    kube.create_es("killed", maxReplicas=2, resources={"gpu": 0})
    made = wait_for("the first child", lambda: kube.child(DEPLOYMENTS, "killed"), interval=0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    missing = {plural for plural in WITH_HPA if kube.child(plural, "killed") is None}
    assert missing, "the reconcile had finished before the kill: the test proves nothing"
    faulty.faults = Faults()
    operators("second")
    wait_for("killed converged", lambda: converged(kube, "killed", WITH_HPA), timeout=CONVERGE_TIMEOUT_S)
    assert_no_strays(kube)
    # What the first operator made was kept, not deleted and made again.
    assert kube.child(DEPLOYMENTS, "killed")["metadata"]["uid"] == made["metadata"]["uid"]  # type: ignore[index]


def _leading(log: Path) -> bool:
    """Whether an operator's last word on peering was to resume (a replica starts paused)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.rfind("Resuming operations") > text.rfind("Pausing operations")


def _peered(logs: list[Path]) -> bool:
    """Both replicas up and keeping their peering records alive, exactly one of them leading."""
    alive = all(log.read_text(errors="replace").count("Keep-alive in") >= 2 for log in logs)
    return alive and sum(map(_leading, logs)) == 1


def _acted_on(log: Path, name: str) -> bool:
    """Whether this operator ran the reconcile loop of ``name`` (its daemon started there)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return f"[default/{name}] Daemon 'reconcile_loop' is invoked" in text


@pytest.mark.process
def test_two_replicas_one_leads_the_other_takes_over(kube: Kube, operators: StartOperator) -> None:
    first, second = operators("replica-a"), operators("replica-b")
    logs = {first: first.log, second: second.log}  # type: ignore[attr-defined]
    wait_for("one replica leading, one standing by", lambda: _peered(list(logs.values())))
    kube.create_es("led", resources={"gpu": 0})
    wait_for("led converged", lambda: converged(kube, "led", FIXED))
    acting = [process for process, log in logs.items() if _acted_on(log, "led")]
    assert len(acting) == 1, "both replicas reconciled the same resource"
    (leader,) = acting
    (standby,) = [process for process in logs if process is not leader]

    leader.send_signal(signal.SIGKILL)
    leader.wait(10)
    kube.create_es("after", resources={"gpu": 0})
    wait_for("the standby to take over", lambda: converged(kube, "after", FIXED), timeout=PEERING_LIFETIME_S + 30)
    assert _acted_on(logs[standby], "after") and _acted_on(logs[standby], "led")
    assert_no_strays(kube)


def test_faults_hit_only_the_operator(kube: Kube, faulty: FaultyEmulator) -> None:
    """The tests' own view of the cluster is never faulted, so what they assert is the truth."""
    faulty.faults = Faults(write_share=1.0)
    kube.create_es("truth", resources={"gpu": 0})
    assert kube.es("truth")["metadata"]["name"] == "truth"
