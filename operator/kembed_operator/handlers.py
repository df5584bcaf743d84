"""kopf wiring: one reconcile loop (a kopf daemon) per EmbeddingService, woken by events.

Run with ``kopf run -m kembed_operator.handlers --all-namespaces``, or ``--namespace=NS`` once for
each namespace to serve (the chart's namespaced install, with Roles only); the chart adds peering
for leader election and ``--liveness`` for the operator's own probes.

Why a daemon and not on-create/on-update handlers: kopf keeps a handler's retry state in a PATCH
of the resource, and when that PATCH fails the retry is lost until another event comes. A daemon
keeps its state in memory: it reconciles, and after a failure of any kind it tries again on its
own timer with exponential backoff. Events (the resource's own, or any of its children's) only
wake it. kopf puts a finalizer on every EmbeddingService for this, so that it can stop the daemon
before the resource goes; deleting one therefore needs a running operator.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from kembed_operator import identity, kinds, kube
from kembed_operator.config import OperatorConfig
from kembed_operator.kinds import Kind, Manifest
from kembed_operator.reconcile import Client, Outcome, reconcile

CONFIG = OperatorConfig.from_env()
ES = (kinds.EMBEDDING_SERVICE.group, kinds.EMBEDDING_SERVICE.version, kinds.EMBEDDING_SERVICE.plural)
MAX_BACKOFF_S = 30.0
# Reads come from kopf's index; a resync reads the server itself, in case the index kept an object
# that vanished while a watch was being re-listed (kopf does not drop those).
RESYNC_S = 600.0
# After a wake-up, let the burst of events behind it (our own writes echoing back) reach the
# indexes first: one reconcile for the burst, reading an index that has caught up.
SETTLE_S = 0.5
OUR_CHILDREN = {identity.LABEL_MANAGED_BY: identity.MANAGED_BY}  # the label every child of ours carries
API = kube.KubeClient()
_WAKEUPS: dict[tuple[str, str], asyncio.Event] = {}  # (namespace, name) -> its loop's wake-up call


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.INFO  # creations, updates and problems become Events
    # kopf freezes every replica that shares the top priority; a random one elects a single leader.
    settings.peering.priority = random.SystemRandom().randint(1, 2**31)
    settings.peering.lifetime = CONFIG.peering_lifetime_s
    # Serving listed namespaces, kopf would list namespaces and watch CRDs, which Roles cannot grant:
    # it takes the listed namespaces as existing and discovers resources once, at start.
    settings.scanning.disabled = not settings.peering.clusterwide
    kube.connect()


def index_id(kind: Kind) -> str:
    """The keyword under which kopf passes the index of one child kind."""
    return f"{kind.plural}_index"


def _index_child(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict[Any, Manifest]:
    """(namespace, owner name) -> the child as the last watch event showed it."""
    return {(namespace, labels.get(identity.LABEL_INSTANCE, "")): dict(body)}


async def _wake_owner(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    _wake(namespace, labels.get(identity.LABEL_INSTANCE, ""))


for _kind in kinds.CHILDREN:
    _resource = (_kind.group, _kind.version, _kind.plural)
    kopf.index(*_resource, labels=OUR_CHILDREN, id=index_id(_kind))(_index_child)
    kopf.on.event(*_resource, labels=OUR_CHILDREN, id=f"wake_{_kind.plural}")(_wake_owner)


@kopf.on.event(*ES)
async def wake_on_change(namespace: str | None, name: str, **_: Any) -> None:
    """A spec change (or a status someone else wrote): wake the resource's loop."""
    _wake(namespace, name)


def _wake(namespace: str | None, name: str) -> None:
    event = _WAKEUPS.get((namespace or "", name))
    if event is not None:
        event.set()


class IndexedClient(kube.KubeClient):
    """Reads served from kopf's watch-fed indexes (a reconcile on an event costs no GET); writes as usual."""

    def __init__(self, indexes: Mapping[Kind, kopf.Index[Any, Manifest]]) -> None:
        self._indexes = indexes

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None:
        store: Iterable[Manifest] = self._indexes[kind].get((namespace, name), [])
        return next(iter(store), None)


@kopf.daemon(*ES)
async def reconcile_loop(
    body: kopf.Body, name: str, stopped: kopf.DaemonStopped, logger: kopf.Logger, **kwargs: Any
) -> None:
    """Reconcile on start and on every wake-up; after a failure, again after a backoff."""
    namespace = body["metadata"]["namespace"]
    cached = IndexedClient({kind: kwargs[index_id(kind)] for kind in kinds.CHILDREN})
    wake = _WAKEUPS.setdefault((namespace, name), asyncio.Event())
    loop = asyncio.get_running_loop()
    failures, resync_at = 0, loop.time() + _resync_delay()
    try:
        while not stopped:
            wake.clear()
            fresh = failures > 0 or loop.time() >= resync_at  # after a failure, trust only the server
            resync_at = loop.time() + _resync_delay() if fresh else resync_at
            failures, retry_after = await _attempt(body, API if fresh else cached, failures, logger)
            if failures:  # wake-ups do not cut a backoff short: our own partial progress makes them
                await stopped.wait(max(retry_after, backoff(failures)))
            elif await _wait(wake, stopped, resync_at - loop.time()):
                await stopped.wait(SETTLE_S)
    finally:
        _WAKEUPS.pop((namespace, name), None)


def _resync_delay() -> float:
    return RESYNC_S * random.uniform(0.9, 1.1)  # resources made together do not resync together


def backoff(failures: int) -> float:
    """Seconds before attempt ``failures + 1``: 1, 2, 4 ... up to 30, with jitter against herds."""
    return min(MAX_BACKOFF_S, 2.0 ** (failures - 1)) * random.uniform(0.75, 1.0)


async def _attempt(body: kopf.Body, client: Client, failures: int, logger: kopf.Logger) -> tuple[int, float]:
    """One reconcile of a snapshot of ``body``; returns (failures in a row, server's Retry-After)."""
    snapshot = copy.deepcopy(dict(body))
    try:
        outcome = await asyncio.to_thread(reconcile, snapshot, CONFIG, client, failures)
    except Exception as err:  # whatever it was (an API error writing the status, a bug): try again
        logger.warning("reconcile failed (attempt %d), will retry: %r", failures + 1, err)
        return failures + 1, kube.retry_after(err)
    _post(body, outcome)
    if outcome.error is not None:
        logger.warning("reconcile failed (attempt %d), will retry: %s", failures + 1, outcome.error.reason)
        return failures + 1, kube.retry_after(outcome.error)
    return 0, 0.0


async def _wait(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> bool:
    """Wait for a wake-up, the daemon's stop or the timeout; True when woken."""
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    _, pending = await asyncio.wait(waiters, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
    for waiter in pending:
        waiter.cancel()
    return wake.is_set()


def _post(body: kopf.Body, outcome: Outcome) -> None:
    for change in outcome.changes:
        kopf.info(body, reason=change.split()[0].capitalize(), message=change)
    for warning in outcome.warnings:
        kopf.warn(body, reason=warning.reason, message=warning.message)
