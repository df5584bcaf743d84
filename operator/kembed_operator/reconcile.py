"""One reconcile: parse, render, bring every child in line, write the status. Idempotent.

A child is written only when the live object lacks something the rendered one has (the API
server's defaults and other managers' fields are extra, not drift; quantities compare by value),
so a converged service costs no write and no write ever echoes back as a new event to react to.
The API is reached only through the :class:`Client` it is given: the handlers pass one that reads
from kopf's watch-fed index (no GETs) or, after a failure, one that reads the server itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity

from kembed_operator import access, kinds, kube, render, status, trust
from kembed_operator.config import OperatorConfig
from kembed_operator.kinds import Kind, Manifest
from kembed_operator.spec import InvalidSpec, parse_spec

# Fields the API server stores as a canonical Quantity (`4000m` comes back as `4`).
QUANTITY_KEYS = frozenset({"cpu", "memory", "ephemeral-storage", render.GPU_RESOURCE, "sizeLimit", "averageValue"})


class Client(Protocol):
    """The calls a reconcile makes; :class:`kembed_operator.kube.KubeClient` is the real one."""

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None: ...
    def create(self, kind: Kind, namespace: str, body: Manifest) -> Manifest: ...
    def apply(self, kind: Kind, namespace: str, name: str, body: Manifest) -> Manifest: ...
    def delete(self, kind: Kind, namespace: str, name: str) -> None: ...
    def patch_status(self, kind: Kind, namespace: str, name: str, status: Manifest) -> Manifest: ...
    def select(self, kind: Kind, namespace: str, labels: Mapping[str, str]) -> list[Manifest]: ...


@dataclass
class ReconcileResult:
    """What a reconcile did, for events and logs; ``error`` set means it must be tried again."""

    changes: list[str] = field(default_factory=list)  # e.g. "created Deployment/emb"
    problem: status.Problem | None = None
    warnings: list[status.Problem] = field(default_factory=list)  # not in the status before: Warning events
    error: ApiException | None = None  # a transient API error that stopped the children's sync


def reconcile(body: Mapping[str, Any], config: OperatorConfig, client: Client, failures: int = 0) -> ReconcileResult:
    """``failures``: how many attempts in a row failed before this one (the status says so from the second)."""
    meta = body["metadata"]
    owner = render.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    previous = dict(body.get("status") or {})
    result = ReconcileResult()
    live: dict[Kind, Manifest | None] = {}
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
        trust.check_service(spec, config)
        children = render.render(owner, spec, config)
        model = render.model_name(spec)
        transport = access.transport(spec)
        metrics = access.metrics_admitted(spec, config)
    except InvalidSpec as err:
        # Keep the children as they are: the last good spec goes on serving while a human fixes this one.
        result.problem = status.Problem(err.reason, str(err))
        model = previous.get("model", "")
        transport = previous.get("transport", "plaintext")
        metrics = status.NOT_APPLIED
    else:
        live = _sync_all(client, owner, children, result)
    if result.error is not None and failures > 0 and result.problem is None:
        result.problem = status.Problem("ApiUnavailable", f"{describe(result.error)}; retrying")
    deployment = (
        live[kinds.DEPLOYMENT]
        if kinds.DEPLOYMENT in live
        else client.get(kinds.DEPLOYMENT, owner.namespace, owner.name)
    )
    observed = status.Observed(
        generation=int(meta.get("generation", 0)),
        deployment=deployment,
        problem=result.problem,
        selector=render.selector(owner.name),
        endpoint=render.endpoint(owner),
        rest_endpoint=render.rest_endpoint(owner, tls=transport != "plaintext"),
        model=model,
        metrics=metrics,
        transport=transport,
    )
    result.warnings = _new_warnings(result.problem, metrics, previous)
    new = status.compute(observed, previous, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    if status.changed(new, previous):
        client.patch_status(kinds.EMBEDDING_SERVICE, owner.namespace, owner.name, new)
    return result


def _new_warnings(problem: status.Problem | None, metrics: status.Verdict, previous: Manifest) -> list[status.Problem]:
    """What the previous status did not report yet and is worth a Warning event."""
    candidates = [(problem, "Degraded")]
    if metrics.alarming:
        candidates.append((status.Problem(metrics.reason, metrics.message), "MetricsAdmitted"))
    return [p for p, kind in candidates if p is not None and _is_new(p, previous, kind)]


def _is_new(problem: status.Problem, previous: Manifest, kind: str) -> bool:
    """Whether the previous status's ``kind`` condition did not already report ``problem``."""
    old: Manifest = next((c for c in previous.get("conditions", []) if c.get("type") == kind), {})
    return (old.get("reason"), old.get("message")) != (problem.reason, problem.message)


def _sync_all(
    client: Client, owner: render.Owner, children: list[render.Desired], result: ReconcileResult
) -> dict[Kind, Manifest | None]:
    """Each child brought in line; returns the live objects reached (the Deployment feeds the status)."""
    wanted = {child.kind for child in children}
    live: dict[Kind, Manifest | None] = {}
    try:
        for child in children:
            action, live[child.kind] = _sync(client, owner, child)
            _record(result, action, child.kind, owner.name)
        for kind in kinds.CHILDREN:
            if kind not in wanted:
                _record(result, _remove(client, owner, kind), kind, owner.name)
    except ApiException as err:
        if kube.is_transient(err):
            result.error = err
        else:  # a child the API server refuses (quota, admission webhook): say so, go on
            result.problem = status.Problem("ApplyRejected", describe(err))
    except OwnershipError as err:
        result.problem = status.Problem("NameConflict", str(err))
    return live


class OwnershipError(Exception):
    """A child's name is taken by an object this EmbeddingService does not own."""


def _sync(client: Client, owner: render.Owner, child: render.Desired) -> tuple[str | None, Manifest]:
    kind, namespace = child.kind, owner.namespace
    live = client.get(kind, namespace, owner.name)
    if live is None:
        return "created", client.create(kind, namespace, _merge(child.manifest, child.on_create))
    _check_owned(live, owner, kind)
    if _immutable_changed(live, child.manifest):
        # The API server refuses the change in place: delete and create again (a short gap in DNS).
        client.delete(kind, namespace, owner.name)
        return "replaced", client.create(kind, namespace, _merge(child.manifest, child.on_create))
    if contains(live, child.manifest):
        return None, live
    return "updated", client.apply(kind, namespace, owner.name, child.manifest)


def _immutable_changed(live: Manifest, wanted: Manifest) -> bool:
    """A Service switching between ClusterIP and Headless (``clusterIP: None``), which is immutable."""
    if kinds.of(wanted) != kinds.SERVICE:
        return False
    return bool((live["spec"].get("clusterIP") == "None") != (wanted["spec"].get("clusterIP") == "None"))


def _remove(client: Client, owner: render.Owner, kind: Kind) -> str | None:
    live = client.get(kind, owner.namespace, owner.name)
    if live is None or not owned(live, owner):
        return None
    client.delete(kind, owner.namespace, owner.name)
    return "deleted"


def _record(result: ReconcileResult, action: str | None, kind: Kind, name: str) -> None:
    if action is not None:
        result.changes.append(f"{action} {kind.kind}/{name}")


def owned(live: Manifest, owner: render.Owner) -> bool:
    return any(ref.get("uid") == owner.uid for ref in live.get("metadata", {}).get("ownerReferences", []))


def _check_owned(live: Manifest, owner: render.Owner, kind: Kind) -> None:
    if not owned(live, owner):
        raise OwnershipError(f"{kind.kind} {owner.name} exists and is not owned by this {owner.kind.kind}")


def contains(live: Any, wanted: Any, key: str = "") -> bool:
    """Whether ``live`` has everything ``wanted`` has (dicts may hold more; lists match item by item;
    quantities match by value)."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v, k) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (
            isinstance(live, list)
            and len(live) == len(wanted)
            and all(contains(a, b, key) for a, b in zip(live, wanted, strict=True))
        )
    if key in QUANTITY_KEYS and isinstance(live, str) and isinstance(wanted, str) and live != wanted:
        return _same_quantity(live, wanted)
    return bool(live == wanted)


def _same_quantity(live: str, wanted: str) -> bool:
    try:
        return bool(parse_quantity(live) == parse_quantity(wanted))
    except ValueError:
        return False


def _merge(base: Manifest, extra: Manifest) -> Manifest:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def describe(err: ApiException) -> str:
    try:
        message = str(json.loads(err.body or "{}").get("message", err.body))
    except ValueError:
        message = str(err.body)
    return f"{err.status} {err.reason}: {message}"
