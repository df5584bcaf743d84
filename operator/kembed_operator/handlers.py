"""kopf wiring: one reconcile loop (a kopf daemon) per EmbeddingService and per EmbeddingJob, woken by events.

Run with ``kopf run -m kembed_operator.handlers --all-namespaces``, or ``--namespace=NS`` once for
each namespace to serve (the chart's namespaced install, with Roles only); the chart adds peering
for leader election and ``--liveness`` for the operator's own probes.

Why a daemon and not on-create/on-update handlers: kopf keeps a handler's retry state in a PATCH
of the resource, and when that PATCH fails the retry is lost until another event comes. A daemon
keeps its state in memory: it reconciles, and after a failure of any kind it tries again on its
own timer with exponential backoff. Events only wake it: an EmbeddingService's loop wakes on its
own events and its children's; an EmbeddingJob's on its own, its Job's and its pods', and its
service's. Watches carry label selectors, so the API server sends only the operator's own objects.
Reconciles read kopf's indexes, which an audit checks against the API server after kopf re-lists
(audit.py: kopf keeps what was deleted while a watch was down).
kopf puts a finalizer on every resource for this, so that it can stop the daemon before the
resource goes; deleting one therefore needs a running operator. Deleting an EmbeddingJob also
deletes its Job, and with it the Job's pods.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kembed.config.values import ConfigError
from kembed_operator import audit, identity, job_render, job_status, kinds, kube
from kembed_operator.config import OperatorConfig
from kembed_operator.job_reconcile import reconcile_job
from kembed_operator.kinds import Kind, Manifest
from kembed_operator.kube import selector
from kembed_operator.reconcile import Client, ReconcileResult, owned, reconcile
from kembed_operator.render import Owner

ES = (kinds.EMBEDDING_SERVICE.group, kinds.EMBEDDING_SERVICE.version, kinds.EMBEDDING_SERVICE.plural)
EJ = (kinds.EMBEDDING_JOB.group, kinds.EMBEDDING_JOB.version, kinds.EMBEDDING_JOB.plural)
MAX_BACKOFF_S = 30.0
# Reads come from kopf's index, audited against the server (audit.py); a resync reads the server
# itself now and then, against whatever else could leave the index behind.
RESYNC_S = 600.0
# After a wake-up, let the burst of events behind it (our own writes echoing back) reach the
# indexes first: one reconcile for the burst, reading an index that has caught up.
SETTLE_S = 0.5
OUR_CHILDREN = {identity.LABEL_MANAGED_BY: identity.MANAGED_BY}  # the label every child of ours carries
OUR_JOBS = {**OUR_CHILDREN, identity.LABEL_COMPONENT: job_render.COMPONENT}
Reconcile = Callable[[Mapping[str, Any], OperatorConfig, Client, int], ReconcileResult]


@dataclass
class Shared:
    """What every handler shares, built at start-up and kept in kopf's memo (``memo.shared``)."""

    config: OperatorConfig
    api: kube.KubeClient
    # (plural, namespace, name) -> its loop's wake-up call
    wakeups: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)

    def wake(self, kind: Kind, namespace: str | None, name: str) -> None:
        event = self.wakeups.get((kind.plural, namespace or "", name))
        if event is not None:
            event.set()

    def runs_here(self, kind: Kind, namespace: str, name: str) -> bool:
        return (kind.plural, namespace, name) in self.wakeups


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """The settings read, kopf configured, what the handlers share built, and the audit started."""
    try:
        config = OperatorConfig.from_env()
    except ConfigError as err:  # a bad setting stops the operator, naming the variable: no retry mends it
        raise kopf.PermanentError(str(err)) from None
    settings.posting.level = logging.INFO  # creations, updates and problems become Events
    # kopf freezes every replica that shares the top priority; a random one elects a single leader.
    settings.peering.priority = random.SystemRandom().randint(1, 2**31)
    settings.peering.lifetime = config.peering_lifetime_s
    # Serving listed namespaces, kopf would list namespaces and watch CRDs, which Roles cannot grant:
    # it takes the listed namespaces as existing and discovers resources once, at start.
    settings.scanning.disabled = not settings.peering.clusterwide
    # The API server sends only our own objects: not every Deployment, Job or pod of the cluster.
    for kind in kinds.CHILDREN:
        settings.watching.label_selectors[kind.group, kind.version, kind.plural] = selector(OUR_CHILDREN)
    for kind in (kinds.JOB, kinds.POD):
        settings.watching.label_selectors[kind.group, kind.version, kind.plural] = selector(OUR_JOBS)
    kube.connect()
    memo.shared = Shared(config, kube.KubeClient())
    memo.audit = asyncio.create_task(_auditor(settings, memo.shared, kwargs).run())


def index_id(kind: Kind) -> str:
    """The keyword under which kopf passes the index of one kind."""
    return f"{kind.plural}_index"


def _index_child(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict[Any, Manifest]:
    """(namespace, owner name) -> the child as the last watch event showed it."""
    return {(namespace, labels.get(identity.LABEL_INSTANCE, "")): dict(body)}


def _index_pod(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict[Any, Manifest]:
    """(namespace, EmbeddingJob name) -> what the status reads of one of its pods."""
    return {(namespace, labels.get(identity.LABEL_INSTANCE, "")): job_status.trimmed(dict(body))}


def _index_service(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Manifest]:
    """(namespace, name) -> the EmbeddingService, for the jobs that call it."""
    return {(namespace, name): dict(body)}


def _index_job_by_service(namespace: str | None, name: str, spec: kopf.Spec, **_: Any) -> dict[Any, str]:
    """(namespace, service) -> the EmbeddingJobs that call it, to wake when it changes."""
    return {(namespace, spec.get("service", "")): name}


async def _wake_service(
    namespace: str | None, labels: Mapping[str, str], event: kopf.RawEvent, memo: kopf.Memo, **_: Any
) -> None:
    _on_owned(memo.shared, kinds.EMBEDDING_SERVICE, namespace, labels, event)


async def _wake_job(
    namespace: str | None, labels: Mapping[str, str], event: kopf.RawEvent, memo: kopf.Memo, **_: Any
) -> None:
    _on_owned(memo.shared, kinds.EMBEDDING_JOB, namespace, labels, event)


def _on_owned(
    shared: Shared, owner: Kind, namespace: str | None, labels: Mapping[str, str], event: kopf.RawEvent
) -> None:
    """An owned object's event wakes its owner's loop."""
    _relisted(event)
    shared.wake(owner, namespace, labels.get(identity.LABEL_INSTANCE, ""))


def _relisted(event: kopf.RawEvent) -> None:
    """An object kopf listed (type None: a watch started over, maybe after a gap) asks for an audit
    of the indexes, which kopf does not compare with its list."""
    if event["type"] is None:
        audit.relisted()


for _kind in kinds.CHILDREN:
    _resource = (_kind.group, _kind.version, _kind.plural)
    kopf.index(*_resource, labels=OUR_CHILDREN, id=index_id(_kind))(_index_child)
    kopf.on.event(*_resource, labels=OUR_CHILDREN, id=f"wake_{_kind.plural}")(_wake_service)
_JOBS = (kinds.JOB.group, kinds.JOB.version, kinds.JOB.plural)
kopf.index(*_JOBS, labels=OUR_JOBS, id=index_id(kinds.JOB))(_index_child)
kopf.on.event(*_JOBS, labels=OUR_JOBS, id="wake_jobs")(_wake_job)
_PODS = (kinds.POD.group, kinds.POD.version, kinds.POD.plural)
kopf.index(*_PODS, labels=OUR_JOBS, id=index_id(kinds.POD))(_index_pod)
kopf.on.event(*_PODS, labels=OUR_JOBS, id="wake_pods")(_wake_job)
kopf.index(*ES, id=index_id(kinds.EMBEDDING_SERVICE))(_index_service)
kopf.index(*EJ, id="jobs_by_service")(_index_job_by_service)


@kopf.on.event(*ES)
async def wake_on_service_change(
    namespace: str | None, name: str, event: kopf.RawEvent, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A spec change (or a status someone else wrote): wake its loop, and the jobs that call it."""
    _relisted(event)
    memo.shared.wake(kinds.EMBEDDING_SERVICE, namespace, name)
    jobs: kopf.Index[Any, str] = kwargs["jobs_by_service"]
    for job in jobs.get((namespace, name), []):
        memo.shared.wake(kinds.EMBEDDING_JOB, namespace, job)


@kopf.on.event(*EJ)
async def wake_on_job_change(namespace: str | None, name: str, event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _relisted(event)
    memo.shared.wake(kinds.EMBEDDING_JOB, namespace, name)


def _auditor(settings: kopf.OperatorSettings, shared: Shared, indexes: Mapping[str, Any]) -> audit.Auditor:
    """Audits the indexes of owned objects against the API server for as long as the operator runs."""
    services = [audit.Watched(k, indexes[index_id(k)], OUR_CHILDREN, kinds.EMBEDDING_SERVICE) for k in kinds.CHILDREN]
    jobs = [audit.Watched(k, indexes[index_id(k)], OUR_JOBS, kinds.EMBEDDING_JOB) for k in (kinds.JOB, kinds.POD)]
    return audit.Auditor([*services, *jobs], shared.api, settings.peering.clusterwide, shared.runs_here, shared.wake)


@kopf.on.cleanup()
async def stop_audit(memo: kopf.Memo, **_: Any) -> None:
    if "audit" in memo:  # not when start-up failed
        memo.audit.cancel()


class IndexedClient(kube.KubeClient):
    """Reads served from kopf's watch-fed indexes (a reconcile on an event costs no GET); writes as usual."""

    def __init__(self, indexes: Mapping[Kind, kopf.Index[Any, Manifest]]) -> None:
        self._indexes = indexes

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None:
        return next(audit.live(self._indexes[kind].get((namespace, name), [])), None)

    def select(self, kind: Kind, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        """The objects an owner's instance label names (the only selection a reconcile makes)."""
        return list(audit.live(self._indexes[kind].get((namespace, labels[identity.LABEL_INSTANCE]), [])))


@kopf.daemon(*ES)
async def reconcile_loop(
    body: kopf.Body, name: str, stopped: kopf.DaemonStopped, logger: kopf.Logger, memo: kopf.Memo, **kwargs: Any
) -> None:
    """An EmbeddingService: reconcile on start and on every wake-up; after a failure, again after a backoff."""
    cached = IndexedClient({kind: kwargs[index_id(kind)] for kind in kinds.CHILDREN})
    await _loop(memo.shared, kinds.EMBEDDING_SERVICE, reconcile, cached, body, name, stopped, logger)


@kopf.daemon(*EJ)
async def job_loop(
    body: kopf.Body, name: str, stopped: kopf.DaemonStopped, logger: kopf.Logger, memo: kopf.Memo, **kwargs: Any
) -> None:
    """An EmbeddingJob: the same loop around its own reconcile."""
    cached = IndexedClient({kind: kwargs[index_id(kind)] for kind in (kinds.JOB, kinds.POD, kinds.EMBEDDING_SERVICE)})
    await _loop(memo.shared, kinds.EMBEDDING_JOB, reconcile_job, cached, body, name, stopped, logger)


@kopf.on.delete(*EJ)
async def delete_job(body: kopf.Body, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The Job goes with its EmbeddingJob, its pods with it (the garbage collector would too, in its time)."""
    meta = body["metadata"]
    owner = Owner(name, meta["namespace"], meta["uid"], kinds.EMBEDDING_JOB)
    await asyncio.to_thread(_delete_owned, memo.shared.api, kinds.JOB, owner)


def _delete_owned(api: kube.KubeClient, kind: Kind, owner: Owner) -> None:
    live = api.get(kind, owner.namespace, owner.name)
    if live is not None and owned(live, owner):
        api.delete(kind, owner.namespace, owner.name)


async def _loop(
    shared: Shared,
    kind: Kind,
    reconcile_one: Reconcile,
    cached: Client,
    body: kopf.Body,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
) -> None:
    namespace = body["metadata"]["namespace"]
    wake = shared.wakeups.setdefault((kind.plural, namespace, name), asyncio.Event())
    loop = asyncio.get_running_loop()
    failures, resync_at = 0, loop.time() + _resync_delay()
    try:
        while not stopped:
            wake.clear()
            fresh = failures > 0 or loop.time() >= resync_at  # after a failure, trust only the server
            resync_at = loop.time() + _resync_delay() if fresh else resync_at
            client = shared.api if fresh else cached
            failures, retry_after = await _attempt(body, reconcile_one, shared.config, client, failures, logger)
            if failures:  # wake-ups do not cut a backoff short: our own partial progress makes them
                await stopped.wait(max(retry_after, backoff(failures)))
            elif await _wait(wake, stopped, resync_at - loop.time()):
                await stopped.wait(SETTLE_S)
    finally:
        shared.wakeups.pop((kind.plural, namespace, name), None)


def _resync_delay() -> float:
    return RESYNC_S * random.uniform(0.9, 1.1)  # resources made together do not resync together


def backoff(failures: int) -> float:
    """Seconds before attempt ``failures + 1``: 1, 2, 4 ... up to 30, with jitter against herds."""
    return min(MAX_BACKOFF_S, 2.0 ** (failures - 1)) * random.uniform(0.75, 1.0)


async def _attempt(
    body: kopf.Body,
    reconcile_one: Reconcile,
    config: OperatorConfig,
    client: Client,
    failures: int,
    logger: kopf.Logger,
) -> tuple[int, float]:
    """One reconcile of a snapshot of ``body``; returns (failures in a row, server's Retry-After)."""
    snapshot = copy.deepcopy(dict(body))
    try:
        result = await asyncio.to_thread(reconcile_one, snapshot, config, client, failures)
    except Exception as err:  # whatever it was (an API error writing the status, a bug): try again
        logger.warning("reconcile failed (attempt %d), will retry: %r", failures + 1, err)
        return failures + 1, kube.retry_after(err)
    _post(body, result)
    if result.error is not None:
        logger.warning("reconcile failed (attempt %d), will retry: %s", failures + 1, result.error.reason)
        return failures + 1, kube.retry_after(result.error)
    return 0, 0.0


async def _wait(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> bool:
    """Wait for a wake-up, the daemon's stop or the timeout; True when woken."""
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    _, pending = await asyncio.wait(waiters, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
    for waiter in pending:
        waiter.cancel()
    return wake.is_set()


def _post(body: kopf.Body, result: ReconcileResult) -> None:
    for change in result.changes:
        kopf.info(body, reason=change.split()[0].capitalize(), message=change)
    for warning in result.warnings:
        kopf.warn(body, reason=warning.reason, message=warning.message)
