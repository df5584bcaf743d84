"""The Dockerfiles read, without building them: what a build here cannot show (the GPU variant), and
what every image, the operator's Deployment and Service and the chart must agree on, from one place
(kembed.contract for the server, the chart's healthPort for the operator).

tests/image/test_*_image.py start the built images (``make image-test``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from images import deps
from kembed.config.settings import Settings
from kembed.contract import GRPC_PORT, HTTP_PORT, LIVEZ_PATH, METRICS_PATH, REST_PORT
from kembed_operator import kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.spec import parse_spec
from tests.operator.conftest import CHART, chart_operator, render_chart

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.server", "Dockerfile.operator"]
INSTRUCTIONS = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "EXPOSE", "USER", "HEALTHCHECK", "ENTRYPOINT", "CMD"}


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, kind: str) -> list[str]:
        return [rest for k, rest in self.instructions if k == kind]


def parse(name: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults and the stages, line continuations joined and comments dropped."""
    logical, pending = [], ""
    for line in (ROOT / name).read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    assert not pending, "a dangling line continuation"
    defaults: dict[str, str] = {}
    stages: list[Stage] = []
    for text in logical:
        kind, rest = text.split(None, 1)
        assert kind in INSTRUCTIONS, kind
        if kind == "FROM":
            base, _, stage_name = rest.partition(" AS ")
            stages.append(Stage(base.strip(), stage_name.strip()))
        elif stages:
            stages[-1].instructions.append((kind, rest))
        else:
            assert kind == "ARG", "only ARG may come before the first FROM"
            key, _, value = rest.partition("=")
            defaults[key] = value
    return defaults, stages


def lineage(stages: list[Stage], defaults: dict[str, str]) -> list[Stage]:
    """The last stage and every stage it is built FROM, defaults filled in."""
    by_name = {stage.name: stage for stage in stages}
    chain: list[Stage] = []
    stage: Stage | None = stages[-1]
    while stage is not None:
        chain.append(stage)
        base = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], stage.base)
        stage = by_name.get(base)
    return chain


def exec_form(stage: Stage, kind: str) -> list[str]:
    (value,) = stage.args(kind)
    return list(json.loads(value))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copies_exist_and_the_context_keeps_them(name: str) -> None:
    ignored = (ROOT / ".dockerignore").read_text().split("\n")
    kept = {line[1:] for line in ignored if line.startswith("!")}
    assert "*" in ignored, ".dockerignore ignores everything it does not name"
    for stage in parse(name)[1]:
        for copy in stage.args("COPY"):
            if copy.startswith("--from="):
                continue
            *sources, _ = shlex.split(copy)
            for source in sources:
                assert (ROOT / source).exists(), copy
                assert source in kept, f"{source} is left out of the build context by .dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_the_deployments_user_and_nothing_of_the_build_reaches_the_image(name: str) -> None:
    """pip's settings and the build's inputs come in as mounts only, each directly below /tmp (in every
    base, so buildah leaves no mount point behind), never as ENV; the last stage runs nothing after it
    names its user, and that user is the one the operator and the chart run pods as."""
    defaults, stages = parse(name)
    mounts = [m for stage in stages for run in stage.args("RUN") for m in run.split() if m.startswith("--mount=")]
    assert [m for m in mounts if "type=secret" in m], "the build reads pip's settings from secrets"
    for mount in mounts:
        options = dict(option.split("=", 1) for option in mount.removeprefix("--mount=").split(","))
        assert Path(options["target"]).parent == Path("/tmp"), mount
    assert not [env for stage in stages for env in stage.args("ENV") if "PIP_" in env]
    final = lineage(stages, defaults)
    kinds = [kind for kind, _ in final[0].instructions]
    assert "RUN" not in kinds[kinds.index("USER") :]
    (user,) = final[0].args("USER")
    assert user == f"{render.RUN_AS}:{render.RUN_AS}"
    assert f"--uid {render.RUN_AS}" in " ".join(run for stage in final for run in stage.args("RUN"))


def test_the_server_image_can_export_the_spans_the_operator_asks_for() -> None:
    """The default extras hold the OpenTelemetry SDK and exporter that kembed.frontend.tracing imports once
    the operator or the chart sets OTEL_EXPORTER_OTLP_ENDPOINT: without them every front end exits 2."""
    final = parse("Dockerfile.server")[1][-1]
    (extras,) = [arg.split("=", 1)[1] for arg in final.args("ARG") if arg.startswith("EXTRAS=")]
    (words,) = shlex.split(extras)  # the quoted default, split as the unquoted $EXTRAS of the RUN is
    installed = {deps.name(line) for line in deps.requirements(ROOT / "pyproject.toml", words.split())}
    otel = {deps.name(line) for line in deps.requirements(ROOT / "pyproject.toml", ["otel"])}
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"} <= otel <= installed


def server_deployment() -> dict[str, Any]:
    owner = render.Owner(name="kembed", namespace="default", uid="static")
    spec = parse_spec({"resources": {"gpu": 0}})
    by_kind = {child.kind: child.manifest for child in render.render(owner, spec, OperatorConfig(default_image="x"))}
    return {"deployment": by_kind[kinds.DEPLOYMENT], "service": by_kind[kinds.SERVICE]}


def test_server_image_deployment_service_and_chart_agree_on_ports_and_probes() -> None:
    """kembed.contract is the one place: EXPOSE, HEALTHCHECK, the rendered Deployment and Service, and
    the chart's PodMonitor all say what it says."""
    final = parse("Dockerfile.server")[1][-1]
    (exposed,) = final.args("EXPOSE")
    contract = {GRPC_PORT, REST_PORT, HTTP_PORT}
    assert {int(port) for port in exposed.split()} == contract
    rendered = server_deployment()
    pod = rendered["deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert set(ports.values()) == contract
    assert {port["port"] for port in rendered["service"]["spec"]["ports"]} == contract
    assert {port["targetPort"] for port in rendered["service"]["spec"]["ports"]} <= set(ports)
    (healthcheck_line,) = final.args("HEALTHCHECK")
    healthcheck = json.loads(healthcheck_line.split(" CMD ", 1)[1])
    liveness = container["livenessProbe"]["httpGet"]
    assert f"'http://127.0.0.1:{ports[liveness['port']]}{liveness['path']}'" in healthcheck[-1]
    assert (ports[liveness["port"]], liveness["path"]) == (HTTP_PORT, LIVEZ_PATH)
    (monitor,) = [d for d in render_chart({"podMonitor": {"enabled": True}}) if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (ports[endpoint["port"]], endpoint["path"]) == (HTTP_PORT, METRICS_PATH)
    env = dict(pair.split("=", 1) for text in final.args("ENV") for pair in text.split() if pair.startswith("KEMBED_"))
    Settings.from_env(env)  # names and values the server accepts
    rendered_env = {var["name"]: var.get("value") for var in container["env"]}
    assert all(rendered_env[name] == value for name, value in env.items())  # the pod says the same
    assert exec_form(final, "ENTRYPOINT") == ["python", "-m", "kembed"]


def test_operator_image_and_chart_agree_on_the_health_port() -> None:
    _, stages = parse("Dockerfile.operator")
    final = stages[-1]
    (exposed,) = final.args("EXPOSE")
    command = exec_form(final, "CMD")
    (liveness,) = [arg.split("=", 1)[1] for arg in command if arg.startswith("--liveness=")]
    health_port = yaml.safe_load((CHART / "values.yaml").read_text())["healthPort"]
    container = chart_operator()
    (port,) = container["ports"]
    assert int(exposed) == health_port == port["containerPort"] == int(liveness.rsplit(":", 1)[1].split("/")[0])
    assert container["livenessProbe"]["httpGet"] == {"path": liveness.split(str(health_port), 1)[1], "port": "health"}
    assert exec_form(final, "ENTRYPOINT") == ["kopf"]
    module = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--module="))
    assert importlib.util.find_spec(module) is not None
    assert [arg for arg in container["args"] if arg.startswith("--module=")] == [f"--module={module}"]


def makefile_command(pattern: str) -> str:
    """A command from the Makefile (what CI runs), continuation lines joined, the venv's path dropped."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(pattern, text.replace("$(BIN)/", ""))
    assert match is not None, pattern
    return " ".join(match.group(0).split())


def test_server_builds_what_ci_builds() -> None:
    """The stubs come from the Makefile's protoc command, and the image's torch from pyproject.toml's pin,
    which is the Makefile's."""
    runs = " ".join(run for stage in parse("Dockerfile.server")[1] for run in stage.args("RUN"))
    assert makefile_command(r"python -m grpc_tools\.protoc [^\n]+?embedder\.proto") in runs
    torch = re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert torch is not None
    (pin,) = [line for line in deps.requirements(ROOT / "pyproject.toml", ["server"]) if deps.name(line) == "torch"]
    assert pin == torch.group(1)
    assert deps.requirements(ROOT / "pyproject.toml", ["server"], "cpu").count(f"{pin}+cpu") == 1


def test_installed_without_dependencies_is_still_a_dependency() -> None:
    """A NO_DEPS entry that pyproject.toml no longer names would silently install nothing."""
    names = {deps.name(line) for line in deps.requirements(ROOT / "pyproject.toml", ["server"])}
    assert set(deps.NO_DEPS) <= names


def test_both_variants_bring_the_compiler_and_headers_torch_compile_needs() -> None:
    """Inductor builds a CPU's forward as C++ extensions, and Triton builds C launchers that include
    Python.h whenever inductor compiles for CUDA (pytorch#116696): both variants carry them."""
    defaults, stages = parse("Dockerfile.server")
    by_name = {stage.name: stage for stage in stages}
    assert stages[-1].base == "runtime-${TORCH_BUILD}" and defaults["TORCH_BUILD"] == "cpu"
    assert by_name["runtime-cpu"].base == by_name["runtime-cu130"].base == "compiler"
    compiler = by_name["compiler"]
    install = next(run for run in compiler.args("RUN") if "apt-get install" in run)
    assert {"python3-dev", "gcc", "g++", "libc6-dev"} <= set(install.split())
    assert [run for run in compiler.args("RUN") if "probe.c" in run]


@pytest.mark.process
def test_the_images_compiler_probe_is_a_working_command(tmp_path: Path) -> None:
    """The probe the GPU build runs, run here with this interpreter standing in for the image's."""
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    stages = {stage.name: stage for stage in parse("Dockerfile.server")[1]}
    (probe,) = [run for run in stages["compiler"].args("RUN") if "probe.c" in run]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = probe.replace("/tmp/probe", str(tmp_path / "probe"))
    done = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
