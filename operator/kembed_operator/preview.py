"""What the operator would make of a file of resources, without a cluster.

``python -m kembed_operator.preview FILE`` reads EmbeddingServices and EmbeddingJobs (YAML, several
documents), renders each one's children as the operator would (its ``KEMBED_OPERATOR_*`` settings read
from the environment, as the chart sets them), checks every child against Kubernetes' own schemas for
``--kube-version`` (``kubernetes-validate``, strict: an unknown field is an error), and prints them as
YAML. A spec the operator would refuse, or a child the schemas refuse, is printed on stderr naming the
resource and field, and the exit code is 1. ``kubectl apply --dry-run=client`` cannot do this offline:
it asks a server for its OpenAPI (localhost:8080 when there is no kubeconfig).

An EmbeddingJob is rendered against the EmbeddingService it names, which must be in the same file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import yaml

from kembed_operator import job_render, kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.job_spec import parse_job_spec
from kembed_operator.kinds import Manifest
from kembed_operator.spec import InvalidSpec, parse_spec

DEFAULT_KUBE_VERSION = "1.34.0"
DEFAULT_NAMESPACE = "default"


class Refused(Exception):
    """A resource the operator, or Kubernetes' schemas, would refuse; the message names it."""


def children(resources: list[Manifest], config: OperatorConfig) -> Iterator[Manifest]:
    """Every child the operator would apply for ``resources``, in their order."""
    services = {_key(r): r for r in resources if _kind(r) == kinds.EMBEDDING_SERVICE}
    for resource in resources:
        kind, (namespace, name) = _kind(resource), _key(resource)
        where = f"{resource.get('kind')} {namespace}/{name}"
        try:
            if kind == kinds.EMBEDDING_SERVICE:
                owner = render.Owner(name, namespace, "preview")
                desired = render.render(owner, parse_spec(resource.get("spec") or {}), config)
            elif kind == kinds.EMBEDDING_JOB:
                desired = [_job(resource, services, config)]
            else:
                raise Refused(f"{where}: not a kind the operator renders")
        except (InvalidSpec, ValueError) as error:
            raise Refused(f"{where}: {error}") from None
        for child in desired:
            yield {**child.manifest, "spec": {**child.manifest.get("spec", {}), **child.on_create.get("spec", {})}}


def _job(resource: Manifest, services: dict[tuple[str, str], Manifest], config: OperatorConfig) -> render.Desired:
    namespace, name = _key(resource)
    spec = parse_job_spec(resource.get("spec") or {})
    service = services.get((namespace, spec.service))
    if service is None:
        raise Refused(f"EmbeddingJob {namespace}/{name}: its service {spec.service!r} is not in the file")
    target = job_render.Target(spec.service, namespace, parse_spec(service.get("spec") or {}))
    owner = render.Owner(name, namespace, "preview", kinds.EMBEDDING_JOB)
    return job_render.render_job(owner, 1, spec, target, config)


def _kind(resource: Manifest) -> kinds.Kind | None:
    written = (resource.get("apiVersion"), resource.get("kind"))
    return next((k for k in (kinds.EMBEDDING_SERVICE, kinds.EMBEDDING_JOB) if (k.api_version, k.kind) == written), None)


def _key(resource: Manifest) -> tuple[str, str]:
    metadata = resource.get("metadata") or {}
    return metadata.get("namespace") or DEFAULT_NAMESPACE, str(metadata.get("name", ""))


def validate(manifests: Iterable[Manifest], kube_version: str) -> None:
    """Each manifest against Kubernetes' schemas for ``kube_version``, strictly."""
    import kubernetes_validate  # a test and tooling dependency, not the operator's

    for manifest in manifests:
        try:
            kubernetes_validate.validate(manifest, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            name = f"{manifest['kind']} {manifest['metadata'].get('name')}"
            raise Refused(f"{name}: {error.message} at {'.'.join(map(str, error.path))}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed_operator.preview", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=argparse.FileType("r"), help="YAML resources; - for stdin")
    parser.add_argument("--kube-version", default=DEFAULT_KUBE_VERSION, help=f"default {DEFAULT_KUBE_VERSION}")
    args = parser.parse_args(argv)
    resources: list[Any] = [doc for doc in yaml.safe_load_all(args.file) if doc]
    try:
        rendered = list(children(resources, OperatorConfig.from_env()))
        validate(rendered, args.kube_version)
    except Refused as error:
        print(f"refused: {error}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(rendered, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
