"""The EmbeddingJob status from its Job's and pods' states, as a table of cases (a pure function)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from kembed_operator import job_render, job_status
from kembed_operator.status import Problem
from tests.operator.test_crd import as_json_schema

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
JOB_UID = "job-uid"
SHARDS = 4


def job(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "wiki", "uid": JOB_UID}, "status": status}


def pod(
    index: int,
    phase: str,
    rows: int | None = None,
    finished: str = T0,
    message: str = "",
    owner: str = JOB_UID,
    error: str | None = None,
    code: int = 1,
    **terminated: Any,
) -> dict[str, Any]:
    """A pod of the Job as the API shows it: its index, phase and the container's termination message
    (the corpus command's summary, with ``error`` when it failed; else ``message``)."""
    summary = {
        "rows": rows,
        "embedded": rows,
        "shard": f"{index}/{SHARDS}",
        "output": "o",
        "complete": phase == "Succeeded",
        "error": error,
    }
    state: dict[str, Any] = {"running": {}}
    if phase in ("Succeeded", "Failed"):
        text = message or (json.dumps(summary) if rows is not None else "")
        exit_code = 0 if phase == "Succeeded" else code
        state = {"terminated": {"exitCode": exit_code, "message": text, "finishedAt": finished, **terminated}}
    return {
        "metadata": {
            "annotations": {job_render.INDEX_ANNOTATION: str(index)},
            "ownerReferences": [{"uid": owner, "controller": True}],
        },
        "status": {"phase": phase, "containerStatuses": [{"name": job_render.CONTAINER, "state": state}]},
    }


def observed(
    job_manifest: dict[str, Any] | None, pods: list[dict[str, Any]] | None, **extra: Any
) -> job_status.JobObserved:
    fields: dict[str, Any] = {"generation": 1, "shards": SHARDS, "manifest": "wiki/emb.manifest.json", "problem": None}
    return job_status.JobObserved(**{**fields, **extra}, job=job_manifest, pods=pods)


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


COMPLETE = {"type": "Complete", "status": "True", "reason": "CompletionsReached", "message": "Reached expected number"}
FAILED = {"type": "Failed", "status": "True", "reason": "FailedIndexes", "message": "Job has failed indexes"}
NOT_UTF8 = "line 5 of shard 2/4 (byte 50 of the input): not UTF-8 (byte 5: invalid start byte)"
FAILED_SHARD_PODS = [
    pod(0, "Succeeded", 10),
    pod(1, "Succeeded", 11),
    pod(2, "Failed", 4, error=NOT_UTF8, code=3),
    pod(3, "Succeeded", 12),
]

CASES: dict[str, tuple[job_status.JobObserved, dict[str, Any], dict[str, tuple[str, str]]]] = {
    # what the operator saw: the counters expected, the conditions expected (status, reason)
    "waiting for a missing service": (
        observed(None, None, problem=Problem("ServiceNotFound", "no EmbeddingService 'bge'")),
        {"shardsSucceeded": 0, "shardsRunning": 0, "rowsWritten": 0, "progress": "0/4"},
        {
            "Progressing": ("False", "ServiceNotFound"),
            "Complete": ("False", "ShardsRemaining"),
            "Failed": ("False", "AsExpected"),
        },
    ),
    "the Job just made": (
        observed(job(), []),
        {"shardsSucceeded": 0, "shardsRunning": 0, "rowsWritten": 0},
        {
            "Progressing": ("True", "ShardsRunning"),
            "Complete": ("False", "ShardsRemaining"),
            "Failed": ("False", "AsExpected"),
        },
    ),
    "two shards done, two running": (
        observed(
            job(active=2, succeeded=2, completedIndexes="0,2", startTime=T0),
            [pod(0, "Succeeded", 10), pod(1, "Running"), pod(2, "Succeeded", 11), pod(3, "Pending")],
        ),
        {"shardsSucceeded": 2, "shardsRunning": 2, "rowsWritten": 21, "progress": "2/4", "startTime": T0},
        {
            "Progressing": ("True", "ShardsRunning"),
            "Complete": ("False", "ShardsRemaining"),
            "Failed": ("False", "AsExpected"),
        },
    ),
    "a retried shard counts its rows once": (
        observed(
            job(
                active=0,
                succeeded=4,
                failed=1,
                completedIndexes="0-3",
                startTime=T0,
                completionTime=T1,
                conditions=[COMPLETE],
            ),
            [
                pod(0, "Succeeded", 10),
                pod(1, "Failed", 6, finished=T0),  # died after committing 6 rows...
                pod(1, "Succeeded", 11, finished=T1),  # ...its retry resumed and wrote the part's 11
                pod(2, "Succeeded", 12),
                pod(3, "Succeeded", 13),
            ],
        ),
        {"shardsSucceeded": 4, "shardsFailed": 0, "podFailures": 1, "rowsWritten": 46, "completionTime": T1},
        {
            "Progressing": ("False", "Complete"),
            "Complete": ("True", "ShardsSucceeded"),
            "Failed": ("False", "AsExpected"),
        },
    ),
    "a shard failed for good": (
        observed(
            job(succeeded=3, failed=4, completedIndexes="0,1,3", failedIndexes="2", conditions=[FAILED]),
            FAILED_SHARD_PODS,
        ),
        {"shardsSucceeded": 3, "shardsFailed": 1, "podFailures": 4, "rowsWritten": 37, "progress": "3/4"},
        {
            "Progressing": ("False", "Failed"),
            "Complete": ("False", "ShardsRemaining"),
            "Failed": ("True", "FailedIndexes"),
        },
    ),
    "a shard failed at once while the others run, saying why": (
        observed(
            job(active=2, succeeded=1, failed=1, completedIndexes="0", failedIndexes="2"),
            [
                pod(0, "Succeeded", 10),
                pod(1, "Running"),
                pod(2, "Failed", 0, error="--dimensions: 1000 exceeds the model's 384", code=3),
                pod(3, "Running"),
            ],
        ),
        {
            "shardsFailed": 1,
            "podFailures": 1,
            "failedShards": [{"shard": 2, "exitCode": 3, "message": "--dimensions: 1000 exceeds the model's 384"}],
        },
        {"Progressing": ("True", "ShardsRunning"), "Failed": ("False", "AsExpected")},
    ),
    "shards that died without a summary: the log's last line, else the kubelet's reason": (
        observed(
            job(active=0, succeeded=2, failed=4, completedIndexes="0,3", failedIndexes="1,2"),
            [
                pod(0, "Succeeded", 10),
                pod(1, "Failed", message="Traceback (most recent call last):\n  ...\nMemoryError\n", finished=T0),
                pod(1, "Failed", message="", code=137, reason="OOMKilled", finished=T1),  # the last one counts
                pod(2, "Failed", 3, error="gave up: no row written for 300 s (--give-up-after)", finished=T1),
                pod(2, "Failed", message="Traceback (most recent call last):\n  ...\nMemoryError\n", finished=T0),
                pod(3, "Succeeded", 12),
            ],
        ),
        {
            "failedShards": [
                {"shard": 1, "exitCode": 137, "message": "OOMKilled"},
                {"shard": 2, "exitCode": 1, "message": "gave up: no row written for 300 s (--give-up-after)"},
            ]
        },
        {"Progressing": ("True", "ShardsRunning")},
    ),
    "another Job's pods and a log tail are not counted": (
        observed(
            job(active=1, succeeded=1, completedIndexes="0"),
            [
                pod(0, "Succeeded", 10),
                pod(0, "Succeeded", 999, owner="an-older-job"),
                pod(1, "Failed", message="Traceback (most recent call last): ..."),
                pod(2, "Failed", message='{"rows": -1}'),
            ],
        ),
        {"shardsSucceeded": 1, "rowsWritten": 10},
        {"Progressing": ("True", "ShardsRunning")},
    ),
}


@pytest.mark.parametrize(("seen", "counters", "expected"), CASES.values(), ids=CASES.keys())
def test_status(
    seen: job_status.JobObserved,
    counters: dict[str, Any],
    expected: dict[str, tuple[str, str]],
    job_crd_schema: dict[str, Any],
) -> None:
    status = job_status.compute(seen, {}, T1)
    assert {key: status.get(key) for key in counters} == counters
    assert {kind: conditions(status)[kind] for kind in expected} == expected
    assert [c["type"] for c in status["conditions"]] == list(job_status.CONDITION_TYPES)
    assert (status["observedGeneration"], status["shards"], status["manifest"]) == (1, SHARDS, "wiki/emb.manifest.json")
    jsonschema.Draft4Validator(as_json_schema(job_crd_schema["properties"]["status"])).validate(status)


def test_a_failed_job_names_its_shards_and_why_the_first_failed() -> None:
    status = job_status.compute(CASES["a shard failed for good"][0], {}, T1)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["message"] == f"shards that failed for good: 2; shard 2: {NOT_UTF8}; Job has failed indexes"
    assert status["failedShards"] == [{"shard": 2, "exitCode": 3, "message": NOT_UTF8}]


def test_a_running_job_says_shards_failed_for_good() -> None:
    status = job_status.compute(CASES["a shard failed at once while the others run, saying why"][0], {}, T1)
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["message"] == "1 of 4 shards done, 2 running, 1 failed for good (status.failedShards says why)"


def test_the_failed_shards_listed_are_the_first_with_their_reasons_cut() -> None:
    """10,000 shards failing keep the status small: the first 20 by index, each reason at most 300 characters."""
    failed = list(range(30))
    pods = [pod(index, "Failed", 0, error="x" * 5000, code=3) for index in reversed(failed)]
    seen = job_status.JobObserved(1, 30, "m", job(failedIndexes="0-29"), pods, None)
    listed = job_status.compute(seen, {}, T1)["failedShards"]
    assert [entry["shard"] for entry in listed] == list(range(job_status.MAX_FAILED_SHARDS_LISTED))
    assert {len(entry["message"]) for entry in listed} == {job_status.MAX_REASON_CHARS}
    gone = job_status.compute(job_status.JobObserved(1, 30, "m", job(failedIndexes="3"), [], None), {}, T1)
    assert gone["failedShards"] == [{"shard": 3}]  # its pods are gone: which shard, without why


def test_a_finished_job_keeps_why_its_shards_failed() -> None:
    seen = CASES["a shard failed for good"][0]
    done = job_status.compute(seen, {}, T0)
    assert job_status.compute(observed(seen.job, None), done, T1)["failedShards"] == done["failedShards"]


def test_a_problem_is_progressings_reason_and_message() -> None:
    status = job_status.compute(observed(None, None, problem=Problem("ImageNotAllowed", "spec.image: 'x'")), {}, T0)
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert (progressing["reason"], progressing["message"]) == ("ImageNotAllowed", "spec.image: 'x'")


def test_transition_times_move_only_on_a_flip() -> None:
    running = job(active=2, completedIndexes="0")
    first = job_status.compute(observed(running, []), {}, T0)
    later = job_status.compute(observed(job(active=1, completedIndexes="0,1"), []), first, T1)
    progressing = {c["type"]: c["lastTransitionTime"] for c in later["conditions"]}
    assert progressing == {"Progressing": T0, "Complete": T0, "Failed": T0}
    done = job_status.compute(observed(job(completedIndexes="0-3", conditions=[COMPLETE]), []), later, T1)
    assert {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}["Complete"] == T1


def test_a_finished_job_keeps_its_status_when_the_job_is_gone() -> None:
    seen = CASES["a retried shard counts its rows once"][0]
    done = job_status.compute(seen, {}, T0)
    assert job_status.finished(done)
    assert job_status.compute(observed(None, None), done, T1) == done
    # Pods not read (the job had finished): the rows stay what they were.
    assert job_status.compute(observed(seen.job, None), done, T1)["rowsWritten"] == 46


def test_a_notice_joins_progressings_message() -> None:
    status = job_status.compute(observed(job(active=1), [], problem=None, notice="generation 2 is not applied"), {}, T0)
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["message"] == "0 of 4 shards done, 1 running; generation 2 is not applied"


@pytest.mark.parametrize(("text", "found"), [("", set()), ("3", {3}), ("0,2-4,7", {0, 2, 3, 4, 7}), ("1-1", {1})])
def test_index_lists(text: str, found: set[int]) -> None:
    assert job_status.indexes(text) == found


@pytest.mark.parametrize("case", CASES)
def test_what_the_operator_keeps_of_a_pod_gives_the_same_status(case: str) -> None:
    """The watched pods are kept trimmed (a few hundred bytes each); the status reads them alike."""
    seen = CASES[case][0]
    trimmed = None if seen.pods is None else [job_status.trimmed(p) for p in seen.pods]
    assert job_status.compute(replace(seen, pods=trimmed), {}, T1) == job_status.compute(seen, {}, T1)


def test_what_the_operator_keeps_of_a_pod_is_small() -> None:
    for ended in (
        pod(1, "Failed", message="x" * 4096),  # the end of a log, at the termination message's limit
        pod(1, "Failed", 0, error="x" * 500),  # the longest error a summary carries
    ):
        assert len(json.dumps(job_status.trimmed(ended))) < 700
