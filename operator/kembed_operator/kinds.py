"""Every kind the operator reads or writes, declared once with its apiVersion: the renderer, the API
client, the kopf handlers and the RBAC rules all take their kinds from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kembed_operator import identity

# A Kubernetes object, or a part of one, as the API's JSON.
Manifest = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str = "", subresource: str = "") -> str:
        """The API path of an object, or of the collection in ``namespace`` (every namespace when empty)."""
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        scope = f"namespaces/{namespace}" if namespace else ""
        return "/".join(part for part in (root, scope, self.plural, name, subresource) if part)


DEPLOYMENT: Final = Kind("apps", "v1", "deployments", "Deployment")
SERVICE: Final = Kind("", "v1", "services", "Service")
PDB: Final = Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
HPA: Final = Kind("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")
SCALED_OBJECT: Final = Kind("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject")
NETWORK_POLICY: Final = Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
# Every child an EmbeddingService may own; ones a spec no longer needs are deleted.
CHILDREN: Final = (DEPLOYMENT, SERVICE, PDB, HPA, SCALED_OBJECT, NETWORK_POLICY)
EMBEDDING_SERVICE: Final = Kind(identity.GROUP, identity.VERSION, identity.PLURAL, identity.KIND)
# An EmbeddingJob owns one Job, and reads (never writes) the Job's pods for their termination messages.
JOB: Final = Kind("batch", "v1", "jobs", "Job")
POD: Final = Kind("", "v1", "pods", "Pod")
EMBEDDING_JOB: Final = Kind(identity.GROUP, identity.VERSION, identity.JOB_PLURAL, identity.JOB_KIND)


def of(manifest: Manifest) -> Kind:
    """The child kind of a manifest (by apiVersion and kind)."""
    api_version, kind = manifest["apiVersion"], manifest["kind"]
    return next(k for k in (*CHILDREN, JOB) if (k.api_version, k.kind) == (api_version, kind))
