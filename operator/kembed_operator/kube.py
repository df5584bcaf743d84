"""The only module that talks to the API server: get, create, apply, delete, patch status.

Plain JSON over the official client's transport (its auth, TLS and kubeconfig handling), addressed
by (apiVersion, kind), so the renderer's manifests go out as they are. Every call is checked
against :mod:`kembed_operator.permissions` first: a call missing there would be a 403 in a cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import urllib3.exceptions
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kembed_operator import identity, permissions

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str

    def path(self, namespace: str, name: str = "", subresource: str = "") -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        return "/".join(part for part in (root, "namespaces", namespace, self.plural, name, subresource) if part)


RESOURCES: dict[tuple[str, str], Resource] = {
    ("apps/v1", "Deployment"): Resource("apps", "v1", "deployments"),
    ("v1", "Service"): Resource("", "v1", "services"),
    ("policy/v1", "PodDisruptionBudget"): Resource("policy", "v1", "poddisruptionbudgets"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): Resource("autoscaling", "v2", "horizontalpodautoscalers"),
    ("keda.sh/v1alpha1", "ScaledObject"): Resource("keda.sh", "v1alpha1", "scaledobjects"),
    ("networking.k8s.io/v1", "NetworkPolicy"): Resource("networking.k8s.io", "v1", "networkpolicies"),
}
EMBEDDING_SERVICES = Resource(identity.GROUP, identity.VERSION, identity.PLURAL)
_MANAGER = ("fieldManager", identity.FIELD_MANAGER)


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


def get(res: Resource, namespace: str, name: str) -> Manifest | None:
    """The live object, or None when it (or its whole resource type, e.g. KEDA's) does not exist."""
    try:
        return _call("get", res, "GET", res.path(namespace, name))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def create(res: Resource, namespace: str, body: Manifest) -> Manifest:
    return _call("create", res, "POST", res.path(namespace), body=body, query=[_MANAGER])


def apply(res: Resource, namespace: str, name: str, body: Manifest) -> Manifest:
    """Server-side apply as the operator's field manager: only the fields in ``body`` are claimed,
    so fields other managers own (an autoscaler's replica count) are left alone."""
    query = [_MANAGER, ("force", "true")]
    path = res.path(namespace, name)
    return _call("patch", res, "PATCH", path, body=body, content_type="application/apply-patch+yaml", query=query)


def delete(res: Resource, namespace: str, name: str) -> None:
    try:
        _call("delete", res, "DELETE", res.path(namespace, name))
    except ApiException as err:
        if err.status != 404:
            raise


def patch_status(res: Resource, namespace: str, name: str, status: Manifest) -> Manifest:
    path = res.path(namespace, name, "status")
    body = {"status": status}
    return _call(
        "patch", res, "PATCH", path, body=body, content_type="application/merge-patch+json", subresource="status"
    )


def _call(
    verb: str,
    res: Resource,
    method: str,
    path: str,
    *,
    body: Manifest | None = None,
    content_type: str = "application/json",
    query: list[tuple[str, str]] | None = None,
    subresource: str = "",
) -> Manifest:
    resource = f"{res.plural}/{subresource}" if subresource else res.plural
    if not permissions.allows(res.group, resource, verb):
        raise PermissionError(f"{verb} {res.group}/{resource} is not in kembed_operator.permissions.RULES")
    api = _client()
    headers = {"Accept": "application/json", "Content-Type": content_type}
    request = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*request)
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(http_resp=response)
    return json.loads(response.data) if response.data else {}
