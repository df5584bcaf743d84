"""What the operator would make of a file of resources, without a cluster.

``python -m kembed_operator.preview FILE`` reads EmbeddingServices and EmbeddingJobs (YAML, several
documents), renders each one's children as the operator would (its ``KEMBED_OPERATOR_*`` settings read
from the environment, as the chart sets them), checks every child against Kubernetes' own schemas for
``--kube-version`` (``kubernetes-validate``, strict: an unknown field is an error), and prints them as
YAML. A spec the operator would refuse, or a child the schemas refuse, is printed on stderr naming the
resource and field, and the exit code is 1. ``kubectl apply --dry-run=client`` cannot do this offline:
it asks a server for its OpenAPI (localhost:8080 when there is no kubeconfig).

What would be applied but not work is a warning on stderr (exit 1 with ``--strict``): an image no
registry has (the operator's default before anyone builds and pushes one), and metrics the NetworkPolicy
keeps from Prometheus, so an autoscaler that never scales. Resources without a namespace are in ``-n``'s.

An EmbeddingJob is rendered against the EmbeddingService it names, which must be in the same file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from kembed.config.values import ConfigError
from kembed_operator import access, job_render, kinds, render
from kembed_operator.config import UNPUBLISHED_IMAGE, OperatorConfig
from kembed_operator.job_spec import parse_job_spec
from kembed_operator.kinds import Manifest
from kembed_operator.spec import EmbeddingServiceSpec, InvalidSpec, parse_spec

DEFAULT_KUBE_VERSION = "1.34.0"
DEFAULT_NAMESPACE = "default"


class Refused(Exception):
    """A resource the operator, or Kubernetes' schemas, would refuse; the message names it."""


@dataclass
class Preview:
    """The children the operator would apply, in their order, and what would not work."""

    children: list[Manifest] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def preview(resources: list[Manifest], config: OperatorConfig, namespace: str = DEFAULT_NAMESPACE) -> Preview:
    """What the operator would apply for ``resources``, those without a namespace in ``namespace``."""
    services = {_key(r, namespace): r for r in resources if _kind(r) == kinds.EMBEDDING_SERVICE}
    result = Preview()
    for resource in resources:
        kind, (ns, name) = _kind(resource), _key(resource, namespace)
        where = f"{resource.get('kind')} {ns}/{name}"
        try:
            if kind == kinds.EMBEDDING_SERVICE:
                spec = parse_spec(resource.get("spec") or {})
                desired = render.render(render.Owner(name, ns, "preview"), spec, config)
                result.warnings += [f"{where}: {w}" for w in service_warnings(spec, config)]
            elif kind == kinds.EMBEDDING_JOB:
                job, image = _job(resource, ns, services, config)
                desired = [job]
                result.warnings += [f"{where}: {w}" for w in image_warnings(image)]
            else:
                raise Refused(f"{where}: not a kind the operator renders")
        except (InvalidSpec, ValueError) as error:
            raise Refused(f"{where}: {error}") from None
        for child in desired:
            spec_on_create = {**child.manifest.get("spec", {}), **child.on_create.get("spec", {})}
            result.children.append({**child.manifest, "spec": spec_on_create})
    return result


def service_warnings(spec: EmbeddingServiceSpec, config: OperatorConfig) -> Iterator[str]:
    """What an EmbeddingService's children would get wrong though the API server takes them."""
    yield from image_warnings(render.server_image(spec, config))
    metrics = access.metrics_admitted(spec, config)
    if not metrics.holds:
        yield f"{metrics.message}; the preview reads the operator's default from KEMBED_OPERATOR_METRICS_FROM"


def image_warnings(image: str) -> Iterator[str]:
    if image == UNPUBLISHED_IMAGE:
        yield (
            f"the image {image} is not published, so its pods could not pull it: build it (make image, "
            "docs/images.md), push it to your registry, and name it in spec.image or as the operator's default "
            "(chart value serverImage; the preview reads it from KEMBED_OPERATOR_DEFAULT_IMAGE)"
        )


def _job(
    resource: Manifest, namespace: str, services: dict[tuple[str, str], Manifest], config: OperatorConfig
) -> tuple[render.Desired, str]:
    """The Job and its image."""
    name = _key(resource, namespace)[1]
    spec = parse_job_spec(resource.get("spec") or {})
    service = services.get((namespace, spec.service))
    if service is None:
        raise Refused(f"EmbeddingJob {namespace}/{name}: its service {spec.service!r} is not in the file")
    target = job_render.Target(spec.service, namespace, parse_spec(service.get("spec") or {}))
    owner = render.Owner(name, namespace, "preview", kinds.EMBEDDING_JOB)
    return job_render.render_job(owner, 1, spec, target, config), job_render.image(spec, target, config)


def _kind(resource: Manifest) -> kinds.Kind | None:
    written = (resource.get("apiVersion"), resource.get("kind"))
    return next((k for k in (kinds.EMBEDDING_SERVICE, kinds.EMBEDDING_JOB) if (k.api_version, k.kind) == written), None)


def _key(resource: Manifest, namespace: str) -> tuple[str, str]:
    """(namespace, name); a resource naming another namespace than ``-n`` is refused, as kubectl refuses it."""
    metadata = resource.get("metadata") or {}
    name, own = str(metadata.get("name", "")), metadata.get("namespace")
    if own and own != namespace:
        raise Refused(
            f"{resource.get('kind')} {own}/{name}: its namespace is not -n's ({namespace!r}): give -n {own}, "
            "or leave metadata.namespace out"
        )
    return namespace, name


def validate(manifests: list[Manifest], kube_version: str) -> None:
    """Each manifest against Kubernetes' schemas for ``kube_version``, strictly."""
    import kubernetes_validate  # the preview extra's (make operator-dev), not the operator image's

    for manifest in manifests:
        try:
            kubernetes_validate.validate(manifest, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            name = f"{manifest['kind']} {manifest['metadata'].get('name')}"
            raise Refused(f"{name}: {error.message} at {'.'.join(map(str, error.path))}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed_operator.preview", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=argparse.FileType("r"), help="YAML resources; - for stdin")
    parser.add_argument("-n", "--namespace", default=DEFAULT_NAMESPACE, help=f"default {DEFAULT_NAMESPACE}")
    parser.add_argument("--kube-version", default=DEFAULT_KUBE_VERSION, help=f"default {DEFAULT_KUBE_VERSION}")
    parser.add_argument("--strict", action="store_true", help="exit 1 when there is a warning")
    args = parser.parse_args(argv)
    resources: list[Any] = [doc for doc in yaml.safe_load_all(args.file) if doc]
    try:
        config = OperatorConfig.from_env()
    except ConfigError as error:  # a KEMBED_OPERATOR_* variable the operator would not start with
        parser.error(str(error))
    try:
        result = preview(resources, config, args.namespace)
        validate(result.children, args.kube_version)
    except Refused as error:
        print(f"refused: {error}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(result.children, sys.stdout, sort_keys=False)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 1 if args.strict and result.warnings else 0


if __name__ == "__main__":
    sys.exit(main())
