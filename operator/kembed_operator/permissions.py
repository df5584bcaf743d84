"""Every API call the operator makes, as RBAC rules: the one list the chart's ClusterRole must match.

:mod:`kembed_operator.kube` refuses any call not listed here, and a test compares this list with the
rendered ClusterRole, so the chart grants exactly what the operator uses: no more, no less.
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
# them again after a failure or on a resync, creates, applies and deletes them (an autoscaler a spec
# no longer asks for, a Service whose type changed).
_CHILD = ("get", "list", "watch", "create", "patch", "delete")
_ES = kinds.EMBEDDING_SERVICE

RULES: Final = (
    # The custom resource: kopf lists, watches and patches it (the finalizer its daemon needs).
    _rule(_ES.group, _ES.plural, "list", "watch", "patch"),
    _rule(_ES.group, f"{_ES.plural}/status", "patch"),
    *(_rule(kind.group, kind.plural, *_CHILD) for kind in kinds.CHILDREN),
    # kopf: events for `kubectl describe`, resource discovery, and leader election (peering).
    _rule("", "events", "create"),
    _rule("apiextensions.k8s.io", "customresourcedefinitions", "list", "watch"),
    _rule("kopf.dev", "clusterkopfpeerings", "get", "list", "watch", "patch"),
)


def allows(group: str, resource: str, verb: str) -> bool:
    return any(r.group == group and r.resource == resource and verb in r.verbs for r in RULES)


def triples() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every permission, the form the tests compare."""
    return {(r.group, r.resource, verb) for r in RULES for verb in r.verbs}
