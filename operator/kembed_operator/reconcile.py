"""One reconcile: parse, render, bring every child in line, write the status. Idempotent.

A child is written only when the live object lacks something the rendered one has (the API
server's defaults and other managers' fields are extra, not drift), so a converged service costs
reads only and no write ever echoes back as a new event to react to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from kembed_operator import access, kube, render, status
from kembed_operator.config import OperatorConfig
from kembed_operator.spec import InvalidSpec, parse_spec

Manifest = dict[str, Any]


@dataclass
class Outcome:
    """What a reconcile did, for events and logs."""

    changes: list[str] = field(default_factory=list)  # e.g. "created Deployment/emb"
    problem: status.Problem | None = None
    problem_is_new: bool = False  # not reported by the status before: worth a Warning event


def reconcile(body: Mapping[str, Any], config: OperatorConfig) -> Outcome:
    meta = body["metadata"]
    owner = render.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    previous = dict(body.get("status") or {})
    outcome = Outcome()
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
        children = render.render(owner, spec, config)
        model = render.model_name(spec)
        transport = access.transport(spec)
    except InvalidSpec as err:
        # Keep the children as they are: the last good spec goes on serving while a human fixes this one.
        outcome.problem = status.Problem("InvalidSpec", str(err))
        model = previous.get("model", "")
        transport = previous.get("transport", "plaintext")
    else:
        _sync_all(owner, children, outcome)
    observed = status.Observed(
        generation=int(meta.get("generation", 0)),
        deployment=kube.get(kube.RESOURCES[render.DEPLOYMENT], owner.namespace, owner.name),
        problem=outcome.problem,
        selector=render.selector(owner.name),
        endpoint=render.endpoint(owner),
        model=model,
        transport=transport,
    )
    outcome.problem_is_new = _is_new(outcome.problem, previous)
    new = status.compute(observed, previous, datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    if status.changed(new, previous):
        kube.patch_status(kube.EMBEDDING_SERVICES, owner.namespace, owner.name, new)
    return outcome


def _is_new(problem: status.Problem | None, previous: Manifest) -> bool:
    degraded: Manifest = next((c for c in previous.get("conditions", []) if c.get("type") == "Degraded"), {})
    return problem is not None and (degraded.get("reason"), degraded.get("message")) != (
        problem.reason,
        problem.message,
    )


def _sync_all(owner: render.Owner, children: list[render.Child], outcome: Outcome) -> None:
    wanted = {child.kind for child in children}
    try:
        for child in children:
            _record(outcome, _sync(owner, child), child.kind, owner.name)
        for kind in render.CHILD_KINDS:
            if kind not in wanted:
                _record(outcome, _remove(owner, kind), kind, owner.name)
    except ApiException as err:
        if kube.is_transient(err):
            raise
        # A child the API server refuses (quota, admission webhook, immutable field): say so, go on.
        outcome.problem = status.Problem("ApplyRejected", f"{err.status} {err.reason}: {_message(err)}")
    except OwnershipError as err:
        outcome.problem = status.Problem("NameConflict", str(err))


class OwnershipError(Exception):
    """A child's name is taken by an object this EmbeddingService does not own."""


def _sync(owner: render.Owner, child: render.Child) -> str | None:
    res = kube.RESOURCES[child.kind]
    live = kube.get(res, owner.namespace, owner.name)
    if live is None:
        kube.create(res, owner.namespace, _merge(child.manifest, child.on_create))
        return "created"
    _check_owned(live, owner, child.kind)
    if contains(live, child.manifest):
        return None
    kube.apply(res, owner.namespace, owner.name, child.manifest)
    return "updated"


def _remove(owner: render.Owner, kind: tuple[str, str]) -> str | None:
    res = kube.RESOURCES[kind]
    live = kube.get(res, owner.namespace, owner.name)
    if live is None or not _owned(live, owner):
        return None
    kube.delete(res, owner.namespace, owner.name)
    return "deleted"


def _record(outcome: Outcome, action: str | None, kind: tuple[str, str], name: str) -> None:
    if action is not None:
        outcome.changes.append(f"{action} {kind[1]}/{name}")


def _owned(live: Manifest, owner: render.Owner) -> bool:
    return any(ref.get("uid") == owner.uid for ref in live.get("metadata", {}).get("ownerReferences", []))


def _check_owned(live: Manifest, owner: render.Owner, kind: tuple[str, str]) -> None:
    if not _owned(live, owner):
        raise OwnershipError(f"{kind[1]} {owner.name} exists and is not owned by this EmbeddingService")


def contains(live: Any, wanted: Any) -> bool:
    """Whether ``live`` has everything ``wanted`` has (dicts may hold more; lists match item by item)."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(contains, live, wanted))
    return bool(live == wanted)


def _merge(base: Manifest, extra: Manifest) -> Manifest:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def _message(err: ApiException) -> str:
    try:
        return str(json.loads(err.body or "{}").get("message", err.body))
    except ValueError:
        return str(err.body)
