"""The tests' side of the emulated cluster: the official client reading and writing plain dicts,
and the Deployment controller the emulator lacks."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kmock._internal import rendering
from kubernetes import client

from kembed_operator import kinds
from tests.operator.emulator import TEST_AGENT

NS = "default"
DEPLOYMENTS, SERVICES, HPAS = "apps/v1/deployments", "services", "autoscaling/v2/horizontalpodautoscalers"
PDBS, SCALED_OBJECTS = "policy/v1/poddisruptionbudgets", "keda.sh/v1alpha1/scaledobjects"
JOBS, PODS = "batch/v1/jobs", "pods"
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "UPDATE": "patch", "DELETE": "delete"}
WRITES = frozenset({"create", "patch", "delete"})
PEERING = "clusterkopfpeerings"  # kopf's leader-election keepalive writes here on its own clock


def operator_requests(requests: Iterable[rendering.Request]) -> list[rendering.Request]:
    """The API requests the operator (kopf included) made, in order; discovery aside."""
    return [
        request
        for request in requests
        if request.resource is not None
        and request.resource.plural is not None
        and request.action is not None
        and request.headers.get("User-Agent") != TEST_AGENT
    ]


def operator_calls(requests: Iterable[rendering.Request]) -> list[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every API request the operator (kopf included) made, in order."""
    calls = []
    for request in operator_requests(requests):
        res, action = request.resource, request.action
        assert res is not None and res.plural is not None and action is not None
        resource = f"{res.plural}/{request.subresource}" if request.subresource else res.plural
        calls.append((res.group or "", resource, VERBS[action.name]))
    return calls


def operator_writes(requests: Iterable[rendering.Request]) -> list[tuple[str, str, str]]:
    """The operator's writes, as :func:`operator_calls`, kopf's leader-election keepalive aside."""
    return [call for call in operator_calls(requests) if call[2] in WRITES and call[1] != PEERING]


class Kube:
    """The official client's APIs, reading and writing plain dicts; ``plural`` as in a path, e.g.
    ``apps/v1/deployments``."""

    def __init__(self, api: client.ApiClient, namespace: str = NS) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self._es_path = kinds.EMBEDDING_SERVICE.path(namespace)

    def create_es(self, name: str, **spec: Any) -> str:
        es = kinds.EMBEDDING_SERVICE
        body = {"apiVersion": es.api_version, "kind": es.kind, "metadata": {"name": name}, "spec": spec}
        return str(self._call("POST", self._es_path, body)["metadata"]["uid"])

    def patch_es(self, name: str, spec: dict[str, Any]) -> None:
        self._call("PATCH", f"{self._es_path}/{name}", {"spec": spec}, "application/merge-patch+json")

    def es(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"{self._es_path}/{name}"))

    def delete_es(self, name: str) -> None:
        self._call("DELETE", f"{self._es_path}/{name}")

    def all_es(self) -> list[dict[str, Any]]:
        return list(self._call("GET", self._es_path)["items"])

    def create_ej(self, name: str, **spec: Any) -> str:
        ej = kinds.EMBEDDING_JOB
        body = {"apiVersion": ej.api_version, "kind": ej.kind, "metadata": {"name": name}, "spec": spec}
        return str(self._call("POST", ej.path(self.namespace), body)["metadata"]["uid"])

    def ej(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", kinds.EMBEDDING_JOB.path(self.namespace, name)))

    def patch_ej(self, name: str, spec: dict[str, Any]) -> None:
        path = kinds.EMBEDDING_JOB.path(self.namespace, name)
        self._call("PATCH", path, {"spec": spec}, "application/merge-patch+json")

    def delete_ej(self, name: str) -> None:
        self._call("DELETE", kinds.EMBEDDING_JOB.path(self.namespace, name))

    def all_ej(self) -> list[dict[str, Any]]:
        return list(self._call("GET", kinds.EMBEDDING_JOB.path(self.namespace))["items"])

    def create_child(self, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        """Make an object as a controller would (a Job's pod, say)."""
        return dict(self._call("POST", self._path(plural), body))

    def child(self, plural: str, name: str) -> dict[str, Any] | None:
        """A child as a dict, or None."""
        try:
            return self._call("GET", self._path(plural, name))
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise

    def children(self, plural: str) -> list[dict[str, Any]]:
        """Every object of a child kind in the namespace, whoever made it."""
        return list(self._call("GET", self._path(plural))["items"])

    def patch_child(self, plural: str, name: str, body: dict[str, Any], subresource: str = "") -> None:
        self._call("PATCH", self._path(plural, name, subresource), body, "application/merge-patch+json")

    def delete_child(self, plural: str, name: str) -> None:
        self._call("DELETE", self._path(plural, name))

    def roll_out(self) -> None:
        """Play the Deployment controller: every Deployment's rollout completes at once."""
        for deployment in self.children(DEPLOYMENTS):
            meta, spec = deployment["metadata"], deployment["spec"]
            if deployment.get("status", {}).get("observedGeneration") == meta["generation"]:
                continue
            replicas = int(spec.get("replicas", 1))
            status = {"observedGeneration": meta["generation"], "replicas": replicas, "updatedReplicas": replicas}
            status |= {"readyReplicas": replicas, "availableReplicas": replicas}
            self.patch_child(DEPLOYMENTS, meta["name"], {"status": status}, "status")

    def events(self, name: str) -> list[tuple[str, str]]:
        listed = self.core.list_namespaced_event(self.namespace)
        return [(str(e.type), str(e.reason)) for e in listed.items if e.involved_object.name == name]

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(method=method, resource_path=path, header_params=headers, body=body)
        response = self.api.call_api(*request)
        response.read()
        if not 200 <= response.status < 300:
            raise client.ApiException(http_resp=response)
        return json.loads(response.data or b"{}")

    def _path(self, plural: str, name: str = "", subresource: str = "") -> str:
        parts = plural.split("/")
        root = "/api/v1" if len(parts) == 1 else f"/apis/{parts[0]}/{parts[1]}"
        return "/".join(p for p in (f"{root}/namespaces/{self.namespace}/{parts[-1]}", name, subresource) if p)


def condition(es: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in es.get("status", {}).get("conditions", []) if c["type"] == kind), {})
