"""Every API call the operator makes, as RBAC rules: the lists the chart's roles must match.

:mod:`kembed_operator.kube` refuses any call not in :data:`IN_NAMESPACE`, and tests compare these
lists with the rendered chart, so it grants exactly what the operator uses: no more, no less. The
chart installs one of two sets: :data:`CLUSTER_WIDE` as a ClusterRole (every namespace), or
:data:`NAMESPACED` as a Role in each namespace it is told to watch (no ClusterRole at all).
"""

from __future__ import annotations

from typing import Final, NamedTuple

from kembed_operator import kinds


class Rule(NamedTuple):
    group: str
    resource: str
    verbs: frozenset[str]


def _rule(group: str, resource: str, *verbs: str) -> Rule:
    return Rule(group, resource, frozenset(verbs))


# Children: kopf lists and watches them (its index is what a reconcile reads); the operator reads
# them again after a failure or on a resync, lists them to audit the index (audit.py), creates,
# applies and deletes them (an autoscaler a spec no longer asks for, a Service whose type changed).
_CHILD = ("get", "list", "watch", "create", "patch", "delete")
_ES, _EJ, _JOB, _POD = kinds.EMBEDDING_SERVICE, kinds.EMBEDDING_JOB, kinds.JOB, kinds.POD
_PEERING = ("get", "list", "watch", "patch")

# In every namespace the operator serves.
IN_NAMESPACE: Final = (
    # The custom resources: kopf lists, watches and patches them (the finalizer their daemons need);
    # an EmbeddingJob's reconcile reads its service again after a failure.
    _rule(_ES.group, _ES.plural, "get", "list", "watch", "patch"),
    _rule(_ES.group, f"{_ES.plural}/status", "patch"),
    _rule(_EJ.group, _EJ.plural, "list", "watch", "patch"),
    _rule(_EJ.group, f"{_EJ.plural}/status", "patch"),
    *(_rule(kind.group, kind.plural, *_CHILD) for kind in kinds.CHILDREN),
    # An EmbeddingJob's Job is made once and never changed (its pod template is immutable), and
    # deleted with it; its pods are only read (watched by label, listed by the audit) for their
    # termination messages.
    _rule(_JOB.group, _JOB.plural, "get", "list", "watch", "create", "delete"),
    _rule(_POD.group, _POD.plural, "list", "watch"),
    # kopf: events for `kubectl describe`.
    _rule("", "events", "create"),
)
# Watching every namespace (`--all-namespaces`): kopf also watches CRDs (resource discovery) and
# elects a leader through a cluster-wide ClusterKopfPeering.
CLUSTER_WIDE: Final = (
    *IN_NAMESPACE,
    _rule("apiextensions.k8s.io", "customresourcedefinitions", "list", "watch"),
    _rule("kopf.dev", "clusterkopfpeerings", *_PEERING),
)
# Watching listed namespaces (`--namespace` each): kopf elects a leader through a KopfPeering in each
# of them, and scanning is off (handlers.configure), so it lists neither namespaces nor CRDs.
NAMESPACED: Final = (*IN_NAMESPACE, _rule("kopf.dev", "kopfpeerings", *_PEERING))


def allows(group: str, resource: str, verb: str) -> bool:
    """Whether the operator's own client may make a call (in the namespace of a resource it serves)."""
    return any(r.group == group and r.resource == resource and verb in r.verbs for r in IN_NAMESPACE)


def triples(rules: tuple[Rule, ...] = CLUSTER_WIDE) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every permission, the form the tests compare."""
    return {(r.group, r.resource, verb) for r in rules for verb in r.verbs}
