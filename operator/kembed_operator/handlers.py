"""kopf handlers: thin, each one job; the work is in :mod:`kembed_operator.reconcile`.

Run with ``kopf run -m kembed_operator.handlers --all-namespaces`` (the chart adds peering for
leader election and ``--liveness`` for the operator's own probes).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping
from typing import Any

import kopf

from kembed_operator import identity, kube
from kembed_operator.config import OperatorConfig
from kembed_operator.reconcile import Outcome, reconcile

CONFIG = OperatorConfig.from_env()
ES = (identity.GROUP, identity.VERSION, identity.PLURAL)
MAX_BACKOFF_S = 60.0
CHILDREN = {identity.LABEL_MANAGED_BY: identity.MANAGED_BY}
# kopf runs the spec handler and child-event handlers of one EmbeddingService concurrently (sync
# handlers run in threads); one reconcile at a time per service avoids racing creates (409s).
_LOCKS: dict[tuple[str, str], threading.Lock] = {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping goes into annotations under our group, not into the status we own.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=identity.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=identity.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    # kopf freezes every replica that shares the top priority; a random one elects a single leader.
    settings.peering.priority = random.SystemRandom().randint(1, 2**31)
    kube.connect()


@kopf.index(*ES)
def services(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str | None, str], kopf.Body]:
    """(namespace, name) -> the latest EmbeddingService body, for handlers triggered by its children."""
    return {(namespace, name): body}


@kopf.on.resume(*ES)
@kopf.on.create(*ES)
@kopf.on.update(*ES, field="spec")
def apply_spec(body: kopf.Body, retry: int, **_: Any) -> None:
    """A new or changed spec: render and roll out. Transient API errors are retried with backoff."""
    _reconcile(body, retry)


@kopf.on.event("apps", "v1", "deployments", labels=CHILDREN)
@kopf.on.event("", "v1", "services", labels=CHILDREN)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILDREN)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=CHILDREN)
@kopf.on.event("keda.sh", "v1alpha1", "scaledobjects", labels=CHILDREN)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=CHILDREN)
def repair_child(namespace: str | None, labels: Mapping[str, str], logger: kopf.Logger, **kwargs: Any) -> None:
    """A child changed or vanished: re-render its owner (repairs drift, follows Deployment status)."""
    services: kopf.Index[tuple[str | None, str], kopf.Body] = kwargs["services"]  # kopf passes indices by name
    for owner in services.get((namespace, labels.get(identity.LABEL_INSTANCE, "")), []):
        if owner["metadata"].get("deletionTimestamp"):
            continue  # being deleted: let the garbage collector take the children
        try:
            _reconcile(owner, retry=0)
        except kopf.TemporaryError as err:  # the child's next event (or an operator restart) tries again
            logger.warning("reconcile of %s failed, will retry: %s", owner["metadata"]["name"], err)


def _reconcile(body: kopf.Body, retry: int) -> None:
    meta = body["metadata"]
    try:
        with _LOCKS.setdefault((meta["namespace"], meta["name"]), threading.Lock()):  # setdefault is atomic
            outcome = reconcile(body, CONFIG)
    except Exception as err:
        if kube.is_transient(err):
            raise kopf.TemporaryError(f"transient API error: {err}", delay=min(MAX_BACKOFF_S, 2.0**retry)) from err
        raise
    _post(body, outcome)


def _post(body: kopf.Body, outcome: Outcome) -> None:
    for change in outcome.changes:
        kopf.info(body, reason=change.split()[0].capitalize(), message=change)
    if outcome.problem is not None and outcome.problem_is_new:
        kopf.warn(body, reason=outcome.problem.reason, message=outcome.problem.message)
