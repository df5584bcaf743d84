"""Every API call the operator makes, as RBAC rules: the one list the chart's ClusterRole must match.

:mod:`kembed_operator.kube` refuses any call not listed here, and a test compares this list with the
rendered ClusterRole, so the chart grants exactly what the operator uses: no more, no less.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from kembed_operator import identity


class Rule(NamedTuple):
    group: str
    resource: str
    verbs: frozenset[str]


def _rule(group: str, resource: str, *verbs: str) -> Rule:
    return Rule(group, resource, frozenset(verbs))


# Children: kopf lists and watches them (drift repair); the operator reads, creates, applies and
# deletes them (delete only removes an autoscaler that a spec no longer asks for).
_CHILD = ("get", "list", "watch", "create", "patch", "delete")

RULES: Final = (
    # The custom resource: kopf lists, watches and patches it (its bookkeeping annotations).
    _rule(identity.GROUP, identity.PLURAL, "list", "watch", "patch"),
    _rule(identity.GROUP, f"{identity.PLURAL}/status", "patch"),
    _rule("apps", "deployments", *_CHILD),
    _rule("", "services", *_CHILD),
    _rule("policy", "poddisruptionbudgets", *_CHILD),
    _rule("autoscaling", "horizontalpodautoscalers", *_CHILD),
    _rule("keda.sh", "scaledobjects", *_CHILD),
    _rule("networking.k8s.io", "networkpolicies", *_CHILD),
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
