"""Built images started as Kubernetes would start them: ``podman run`` flags translated from a
rendered pod spec and its container (security contexts, env, emptyDir volumes, memory limit, ports,
arguments), so the tests run each image the way the operator's Deployment or the chart runs it.

A field of the manifests that this does not translate fails the translation: a new field in the
Deployment must be mirrored here, or the tests would run the image unlike a cluster does.
"""

from __future__ import annotations

import json
import resource
import subprocess
import tarfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes.utils.quantity import parse_quantity

Manifest = Mapping[str, Any]

# crun cannot set rlimits in this sandbox, and runc fails on podman's default nofile limit: runc,
# with the limits this machine allows (docs/images.md).
PODMAN = ["podman", "--runtime", "runc"]
NPROC = 4096
# Pod fields that place or name the pod, with nothing for one container on one machine to mirror.
PLACEMENT = {"nodeSelector", "tolerations", "affinity", "serviceAccountName", "imagePullSecrets"}
# The kubelet's side of a container: probes (the tests poll them), the image reference and its pull
# policy. preStop only delays SIGTERM (podman stop sends it at once).
KUBELET = {"name", "image", "imagePullPolicy", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"}


def podman(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)


def http_status(url: str) -> int:
    """The status of a GET (0: nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def ulimits() -> list[str]:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={NPROC}:{NPROC}"]


def image_files(image: str) -> set[str]:
    """Every path in ``image``'s filesystem: read where podman mounts it (root), else from ``podman
    export`` of a container never started."""
    mounted = podman("image", "mount", image)
    if mounted.returncode == 0:
        root = Path(mounted.stdout.strip())
        try:
            return {"/" + str(path.relative_to(root)) for path in root.rglob("*")}
        finally:
            podman("image", "unmount", image)
    created = podman("create", image)
    assert created.returncode == 0, created.stderr
    name = created.stdout.strip()
    try:
        with subprocess.Popen([*PODMAN, "export", name], stdout=subprocess.PIPE) as export:
            assert export.stdout is not None
            with tarfile.open(fileobj=export.stdout, mode="r|") as tar:
                return {"/" + member.name.strip("/") for member in tar}
    finally:
        podman("rm", "--force", name)


class Container:
    """One ``podman run -d`` of ``image`` as ``pod`` runs ``container``; ``host_ports`` maps the
    container's port names to loopback ports to publish on (None: the host's network)."""

    def __init__(
        self,
        image: str,
        pod: Manifest,
        container: Manifest,
        host_ports: Mapping[str, int] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.name = f"kembed-test-{uuid.uuid4().hex[:8]}"
        self.grace_s = int(pod.get("terminationGracePeriodSeconds", 30))
        flags = run_flags(pod, container, host_ports) + (extra or [])
        started = podman("run", "--detach", "--name", self.name, *flags, *command(container, image))
        assert started.returncode == 0, started.stderr

    def running(self) -> bool:
        return self.inspect("{{.State.Running}}") == "true"

    def inspect(self, template: str) -> str:
        return podman("inspect", "--format", template, self.name).stdout.strip()

    def logs(self) -> str:
        done = podman("logs", self.name)
        return done.stdout + done.stderr

    def stop(self) -> subprocess.CompletedProcess[str]:
        """SIGTERM, then SIGKILL after the pod's grace period, as the kubelet does."""
        return podman("stop", "--time", str(self.grace_s), self.name, timeout=self.grace_s + 60)

    def remove(self) -> None:
        podman("rm", "--force", self.name)


def command(container: Manifest, image: str) -> list[str]:
    entrypoint = container.get("command")
    return [*([f"--entrypoint={json.dumps(entrypoint)}"] if entrypoint else []), image, *container.get("args", [])]


def run_flags(pod: Manifest, container: Manifest, host_ports: Mapping[str, int] | None = None) -> list[str]:
    unknown = set(pod) - PLACEMENT - {"containers", "securityContext", "volumes", "terminationGracePeriodSeconds"}
    unknown -= {"automountServiceAccountToken", "enableServiceLinks"}  # nothing of the API reaches podman
    unknown |= set(container) - KUBELET - {"ports", "env", "resources", "securityContext", "volumeMounts"}
    unknown -= {"command", "args"}
    assert not unknown, f"not mirrored by tests/image/podman.py: {sorted(unknown)}"
    flags = ulimits()
    flags += _pod_security(pod.get("securityContext", {}))
    flags += _container_security(container.get("securityContext", {}))
    flags += _volumes(pod.get("volumes", []), container.get("volumeMounts", []))
    flags += _env(container.get("env", []), container.get("resources", {}))
    flags += _memory(container.get("resources", {}))
    if host_ports is None:
        flags += ["--network", "host"]
    else:
        ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
        flags += [f"--publish=127.0.0.1:{host_ports[name]}:{ports[name]}" for name in ports]
    return flags


def _pod_security(context: Manifest) -> list[str]:
    flags = []
    for key, value in context.items():
        if key == "runAsUser":
            flags += ["--user", f"{value}:{context.get('runAsGroup', value)}"]
        elif key == "fsGroup":
            flags += ["--group-add", str(value)]
        elif key == "seccompProfile":
            assert value == {"type": "RuntimeDefault"}, value  # podman applies its default profile
        elif key not in ("runAsGroup", "runAsNonRoot"):  # runAsNonRoot: the --user above is not 0
            raise AssertionError(f"pod securityContext.{key} is not mirrored")
    return flags


def _container_security(context: Manifest) -> list[str]:
    flags = []
    for key, value in context.items():
        if key == "allowPrivilegeEscalation" and value is False:
            flags += ["--security-opt", "no-new-privileges"]
        elif key == "readOnlyRootFilesystem" and value is True:
            flags += ["--read-only", "--read-only-tmpfs=false"]  # writable only where the pod mounts
        elif key == "capabilities" and set(value) <= {"drop", "add"}:
            flags += [f"--cap-drop={cap}" for cap in value.get("drop", [])]
            flags += [f"--cap-add={cap}" for cap in value.get("add", [])]
        elif key != "runAsNonRoot":
            raise AssertionError(f"container securityContext.{key}={value!r} is not mirrored")
    return flags


def _volumes(volumes: list[Manifest], mounts: list[Manifest]) -> list[str]:
    by_name = {volume["name"]: volume for volume in volumes}
    flags = []
    for mount in mounts:
        volume = by_name[mount["name"]]
        if set(volume) != {"name", "emptyDir"} or set(mount) != {"name", "mountPath"}:
            raise AssertionError(f"volume {volume} mounted as {mount} is not mirrored (only emptyDir is)")
        size = volume["emptyDir"].get("sizeLimit")
        options = "rw,mode=1777" + (f",size={int(parse_quantity(size))}" if size else "")
        flags += ["--tmpfs", f"{mount['mountPath']}:{options}"]
    return flags


def _env(env: list[Manifest], resources: Manifest) -> list[str]:
    flags = []
    for var in env:
        value = _resource_field(var["valueFrom"], resources) if "valueFrom" in var else str(var.get("value", ""))
        flags += ["--env", f"{var['name']}={value}"]
    return flags


def _resource_field(source: Manifest, resources: Manifest) -> str:
    """What the kubelet puts in a Downward API ``resourceFieldRef`` variable (rounded up)."""
    if set(source) != {"resourceFieldRef"}:
        raise AssertionError(f"env valueFrom {source} is not mirrored")
    ref = source["resourceFieldRef"]
    group, _, name = ref["resource"].partition(".")
    quantity = parse_quantity(resources[group][name]) / parse_quantity(ref.get("divisor", "1"))
    return str(int(-(-quantity // 1)))


def _memory(resources: Manifest) -> list[str]:
    memory = resources.get("limits", {}).get("memory")
    return ["--memory", str(int(parse_quantity(memory)))] if memory else []
