"""A Job's and its pods' state in, the EmbeddingJob status out (pure; the clock is an argument).

Conditions, each with ``lastTransitionTime`` moving only when its status flips:

- ``Complete``: every shard succeeded (the Job's own ``Complete``).
- ``Failed``: the Job failed (a shard spent its retries, more than ``maxFailedShards`` failed ...);
  the message names the shards.
- ``Progressing``: True while the Job runs; False with why it does not: waiting for its service
  (``ServiceNotFound``, ``ServiceNotReady``), a spec that cannot run (``InvalidSpec``, a refusal of
  :mod:`kembed_operator.trust`, ``NameConflict``, ``ApplyRejected``), or ``Complete`` / ``Failed``.

Counts come from the Job's status (``completedIndexes``, ``failedIndexes``, ``active``, ``failed``);
rows written from the pods' termination messages, the corpus command's summary: per shard, the
succeeded pod's, else the one that ended last (a failed shard keeps the rows it committed). Why a
shard failed for good (``failedShards``, and the ``Failed`` condition's message for the first) comes
from its pod that failed last: its exit code and the error its summary carries, else the end of its
log (the kubelet keeps it when the command died before writing a summary), else the container's
reason (``OOMKilled``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kembed_operator.job_render import CONTAINER, INDEX_ANNOTATION
from kembed_operator.kinds import Manifest
from kembed_operator.status import Problem, condition

CONDITION_TYPES = ("Progressing", "Complete", "Failed")
# Of 10,000 shards all failing, the status lists the first (shardsFailed counts them all), each
# reason cut: the status stays small, and so does what the operator keeps of each pod.
MAX_FAILED_SHARDS_LISTED = 20
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class JobObserved:
    """What the operator knows after a reconcile."""

    generation: int  # the generation the status describes: the one the Job was made from, once it exists
    shards: int
    manifest: str  # where the parts' manifest goes, in the output claim
    job: Manifest | None
    pods: list[Manifest] | None  # None: not read (a finished job's never are)
    problem: Problem | None  # why there is no Job, or none of ours
    notice: str = ""  # added to Progressing's message: a spec change the Job cannot take


def finished(status: Manifest) -> bool:
    """Whether a status says the job is over, for good: the operator never makes its Job again."""
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in status.get("conditions", [])
    )


def compute(observed: JobObserved, previous: Manifest, now: str) -> Manifest:
    """The full status; ``previous`` is the current status (for transition times, and what a finished
    job's deleted Job and pods can no longer say)."""
    if observed.job is None and observed.problem is None and finished(previous):
        return {**previous, "observedGeneration": observed.generation}
    job_status = (observed.job or {}).get("status", {})
    succeeded = len(indexes(job_status.get("completedIndexes", "")))
    failed = indexes(job_status.get("failedIndexes", ""))
    verdicts = {c.get("type"): c for c in job_status.get("conditions", []) if c.get("status") == "True"}
    if observed.pods is None:  # not read: what the status said stays
        rows, why = previous.get("rowsWritten", 0), previous.get("failedShards", [])
    else:
        rows, why = rows_written(observed.job, observed.pods), failed_shards(observed.job, observed.pods, failed)
    shards = observed.shards
    progressing = _progressing(observed, verdicts, succeeded, int(job_status.get("active", 0)), len(failed))
    if observed.notice:
        progressing = (*progressing[:3], "; ".join(filter(None, (progressing[3], observed.notice))))
    conditions = [
        progressing,
        ("Complete", "Complete" in verdicts, *_complete(succeeded, shards, rows, "Complete" in verdicts)),
        ("Failed", "Failed" in verdicts, *_failed(verdicts.get("Failed"), failed, why)),
    ]
    old = {c.get("type"): c for c in previous.get("conditions", [])}
    status: Manifest = {
        "observedGeneration": observed.generation,
        "shards": shards,
        "shardsSucceeded": succeeded,
        "shardsFailed": len(failed),
        "shardsRunning": int(job_status.get("active", 0)),
        "podFailures": int(job_status.get("failed", 0)),
        "progress": f"{succeeded}/{shards}",
        "rowsWritten": rows,
        "failedShards": why,
        "manifest": observed.manifest,
    }
    status |= {key: job_status[key] for key in ("startTime", "completionTime") if key in job_status}
    return status | {"conditions": [condition(*c, old.get(c[0]), now) for c in conditions]}


def _progressing(
    observed: JobObserved, verdicts: dict[Any, Manifest], succeeded: int, running: int, failed: int
) -> tuple[str, bool, str, str]:
    if observed.problem is not None:
        return "Progressing", False, observed.problem.reason, observed.problem.message
    if observed.job is None:
        return "Progressing", False, "JobPending", "the Job is about to be made"
    for verdict in ("Complete", "Failed"):
        if verdict in verdicts:
            return "Progressing", False, verdict, verdicts[verdict].get("message", "")
    message = f"{succeeded} of {observed.shards} shards done, {running} running"
    if failed:
        message += f", {failed} failed for good (status.failedShards says why)"
    return "Progressing", True, "ShardsRunning", message


def _complete(succeeded: int, shards: int, rows: int, complete: bool) -> tuple[str, str]:
    if complete:
        return "ShardsSucceeded", f"{shards} shards, {rows} rows: the manifest lists the parts in order"
    return "ShardsRemaining", f"{succeeded} of {shards} shards succeeded"


def _failed(verdict: Manifest | None, failed: set[int], why: list[Manifest]) -> tuple[str, str]:
    if verdict is None:
        return "AsExpected", ""
    shards = f"shards that failed for good: {_spell(failed)}; " if failed else ""
    first = f"shard {why[0]['shard']}: {why[0]['message']}; " if why and why[0].get("message") else ""
    return str(verdict.get("reason", "JobFailed")), f"{shards}{first}{verdict.get('message', '')}"


def rows_written(job: Manifest | None, pods: list[Manifest]) -> int:
    """Rows in the parts, from the summaries of the Job's own pods (one per shard: see :func:`summaries`)."""
    return sum(int(summary["rows"]) for summary in summaries(job, pods).values())


def summaries(job: Manifest | None, pods: list[Manifest]) -> dict[int, dict[str, Any]]:
    """Shard -> the summary its succeeded pod wrote, else that of its pod that ended last."""
    best: dict[int, tuple[tuple[bool, str], dict[str, Any]]] = {}
    for index, pod in _own(job, pods):
        ended = _terminated(pod)
        summary = _summary(ended.get("message", ""))
        if summary is None:
            continue  # a log's tail, or no message
        rank = (_phase(pod) == "Succeeded", str(ended.get("finishedAt", "")))
        if index not in best or rank > best[index][0]:
            best[index] = (rank, summary)
    return {index: summary for index, (_, summary) in best.items()}


def failed_shards(job: Manifest | None, pods: list[Manifest], failed: set[int]) -> list[Manifest]:
    """The first shards of ``failed``, each with why its pod that failed last failed (``exitCode``,
    ``message``) when that pod is still there."""
    last: dict[int, tuple[str, Manifest]] = {}
    for index, pod in _own(job, pods):
        ended = _terminated(pod)
        finished = str(ended.get("finishedAt", ""))
        if _phase(pod) != "Failed" or (index in last and finished < last[index][0]):
            continue
        why: Manifest = {"shard": index}
        if isinstance(ended.get("exitCode"), int):
            why["exitCode"] = ended["exitCode"]
        if reason := _reason(ended):
            why["message"] = reason
        last[index] = (finished, why)
    listed = sorted(failed)[:MAX_FAILED_SHARDS_LISTED]
    return [last[index][1] if index in last else {"shard": index} for index in listed]


def _own(job: Manifest | None, pods: list[Manifest]) -> Iterator[tuple[int, Manifest]]:
    """(shard, pod) for the Job's own pods: not another Job's (one deleted with an earlier
    EmbeddingJob of this name), nor one without its index."""
    uid = (job or {}).get("metadata", {}).get("uid")
    for pod in pods:
        owners = {ref.get("uid") for ref in pod.get("metadata", {}).get("ownerReferences", [])}
        index = pod.get("metadata", {}).get("annotations", {}).get(INDEX_ANNOTATION, "")
        if uid in owners and index.isdigit():
            yield int(index), pod


def _reason(ended: Manifest) -> str:
    """Why a container failed: what its message says, else the kubelet's reason (``OOMKilled``)."""
    return (_said(str(ended.get("message", ""))) or str(ended.get("reason", "")))[:MAX_REASON_CHARS]


def _said(message: str) -> str:
    """The error in the corpus command's summary; else the last line of the message: the end of
    its log, when it died before writing a summary."""
    summary = _summary(message)
    if summary is not None:
        return str(summary.get("error") or "")
    return next((line.strip() for line in reversed(message.splitlines()) if line.strip()), "")


def trimmed(pod: Manifest) -> Manifest:
    """Only what :func:`summaries` and :func:`failed_shards` read of a pod (a few hundred bytes,
    whatever the pod's size), in the pod's own shape: what the operator keeps of each pod it watches."""
    meta, ended = pod.get("metadata", {}), _terminated(pod)
    index = meta.get("annotations", {}).get(INDEX_ANNOTATION)
    state: Manifest = {}
    if ended:
        kept: Manifest = {key: ended[key] for key in ("exitCode", "reason") if key in ended}
        summary = _summary(ended.get("message", ""))
        if summary is not None:  # its rows and error: the rest of it is for people
            error = _said(ended["message"])[:MAX_REASON_CHARS] or None
            kept["message"] = json.dumps({"rows": summary["rows"], "error": error})
        elif _phase(pod) == "Failed":
            kept["message"] = _reason(ended)
        state = {"terminated": {"finishedAt": ended.get("finishedAt", ""), **kept}}
    return {
        "metadata": {
            "name": meta.get("name", ""),
            "uid": meta.get("uid", ""),  # what tells a pod the indexes keep after its deletion was missed
            "annotations": {} if index is None else {INDEX_ANNOTATION: index},
            "ownerReferences": [{"uid": ref.get("uid")} for ref in meta.get("ownerReferences", [])],
        },
        "status": {
            "phase": _phase(pod),
            "containerStatuses": [{"name": CONTAINER, "state": state}],
        },
    }


def _phase(pod: Manifest) -> str:
    return str(pod.get("status", {}).get("phase", ""))


def _terminated(pod: Manifest) -> Manifest:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    container: Manifest = next((s for s in statuses if s.get("name") == CONTAINER), {})
    return dict(container.get("state", {}).get("terminated") or {})


def _summary(message: str) -> dict[str, Any] | None:
    """The corpus command's summary, or None: a message that is the tail of a log (the command died
    before writing it) or anything else is not counted."""
    try:
        summary = json.loads(message)
    except ValueError:
        return None
    rows = summary.get("rows") if isinstance(summary, dict) else None
    return summary if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 else None


def indexes(text: str) -> set[int]:
    """A Job's index list (``"1,3-5"``) as a set."""
    found: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def _spell(values: set[int]) -> str:
    return ", ".join(str(value) for value in sorted(values))
