"""The only module that talks to the API server: get, select, create, apply, delete, patch status.

:class:`KubeClient` is what :func:`kembed_operator.reconcile.reconcile` is given in production.

Plain JSON over the official client's transport (its auth, TLS and kubeconfig handling), addressed
by :class:`~kembed_operator.kinds.Kind`, so the renderer's manifests go out as they are. Every call is checked
against :mod:`kembed_operator.permissions` first: a call missing there would be a 403 in a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache

import urllib3.exceptions
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kembed_operator import identity, permissions
from kembed_operator.kinds import Kind, Manifest

_MANAGER = ("fieldManager", identity.FIELD_MANAGER)
# A list of PartialObjectMetadata (what kubectl and controller-runtime's metadata informers ask for),
# plain JSON from a server that cannot.
_METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
# (connect, read) seconds: a hung request fails and is retried instead of stalling its reconcile loop.
REQUEST_TIMEOUT_S = (5.0, 30.0)


def connect() -> None:
    """Load credentials: the pod's service account in a cluster, else the kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    _client.cache_clear()


@cache
def _client() -> client.ApiClient:
    return client.ApiClient()


def is_transient(err: Exception) -> bool:
    """Conflicts, throttling, server errors and broken connections: worth retrying with backoff."""
    if isinstance(err, ApiException):
        return err.status in (409, 429) or not err.status or err.status >= 500
    return isinstance(err, urllib3.exceptions.HTTPError)


def retry_after(err: Exception) -> float:
    """Seconds the server asked us to wait (``Retry-After`` on a 429 or 503), else 0."""
    headers = getattr(err, "headers", None) or {}
    try:
        return max(0.0, float(headers.get("Retry-After", 0)))
    except ValueError:  # an HTTP date: rare from the API server, treat as no hint
        return 0.0


class KubeClient:
    """The API server over the official client's transport: every call a request."""

    def get(self, kind: Kind, namespace: str, name: str) -> Manifest | None:
        """The live object, or None when it (or its whole resource type, e.g. KEDA's) does not exist."""
        try:
            return _call("get", kind, "GET", kind.path(namespace, name))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def create(self, kind: Kind, namespace: str, body: Manifest) -> Manifest:
        return _call("create", kind, "POST", kind.path(namespace), body=body, query=[_MANAGER])

    def apply(self, kind: Kind, namespace: str, name: str, body: Manifest) -> Manifest:
        """Server-side apply as the operator's field manager: only the fields in ``body`` are claimed,
        so fields other managers own (an autoscaler's replica count) are left alone."""
        query = [_MANAGER, ("force", "true")]
        path = kind.path(namespace, name)
        return _call("patch", kind, "PATCH", path, body=body, content_type="application/apply-patch+yaml", query=query)

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete, and let the garbage collector take what the object owns (a Job's pods: the API's
        default for a Job is to orphan them)."""
        query = [("propagationPolicy", "Background")]
        try:
            _call("delete", kind, "DELETE", kind.path(namespace, name), query=query)
        except ApiException as err:
            if err.status != 404:
                raise

    def select(self, kind: Kind, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        """The objects of ``kind`` in ``namespace`` that carry every one of ``labels``."""
        items = _call("list", kind, "GET", kind.path(namespace), query=[("labelSelector", selector(labels))])["items"]
        return [item for item in items if labels.items() <= item.get("metadata", {}).get("labels", {}).items()]

    def uids(self, kind: Kind, namespace: str, labels: Mapping[str, str]) -> set[str]:
        """The uids of the objects of ``kind`` carrying ``labels``, in ``namespace`` (every namespace
        when empty): a consistent list, of the objects' metadata only."""
        query = [("labelSelector", selector(labels))]
        listed = _call("list", kind, "GET", kind.path(namespace), query=query, accept=_METADATA_ONLY)
        return {item["metadata"]["uid"] for item in listed["items"]}

    def patch_status(self, kind: Kind, namespace: str, name: str, status: Manifest) -> Manifest:
        path = kind.path(namespace, name, "status")
        body = {"status": status}
        content_type = "application/merge-patch+json"
        return _call("patch", kind, "PATCH", path, body=body, content_type=content_type, subresource="status")


def selector(labels: Mapping[str, str]) -> str:
    """A label selector asking for every one of ``labels``."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def _call(
    verb: str,
    res: Kind,
    method: str,
    path: str,
    *,
    body: Manifest | None = None,
    content_type: str = "application/json",
    query: list[tuple[str, str]] | None = None,
    subresource: str = "",
    accept: str = "application/json",
) -> Manifest:
    resource = f"{res.plural}/{subresource}" if subresource else res.plural
    if not permissions.allows(res.group, resource, verb):
        raise PermissionError(f"{verb} {res.group}/{resource} is not in kembed_operator.permissions.IN_NAMESPACE")
    api = _client()
    headers = {"Accept": accept, "Content-Type": content_type}
    request = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*request, _request_timeout=REQUEST_TIMEOUT_S)
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(http_resp=response)
    return json.loads(response.data) if response.data else {}
