"""The offline check docs/operator.md gives, run as written with only what `make operator-dev` (which
it names) installs (tests/installs.py): the preview commands on the chart's examples and the front
page's EmbeddingService (and what it warns of), and the chart's render-and-validate snippet."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kembed_operator.config import UNPUBLISHED_IMAGE
from tests.installs import run_with_only, target_extras
from tests.operator.test_chart import documented_installs

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operator.md"
EXAMPLES = ROOT / "charts" / "kembed-operator" / "examples"
PREVIEW = ".venv/bin/python -m kembed_operator.preview"
OPERATOR_DEV = target_extras("operator-dev")
SERVICE_KINDS = ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler"]
NO_METRICS = "spec.networkPolicy.metricsFrom"  # what the warning of a closed metrics port tells to set
# The operator's settings the documented install gives, as the chart passes them.
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
INSTALLED = {
    "KEMBED_OPERATOR_DEFAULT_IMAGE": "REGISTRY/kembed-server:0.1.0",
    "KEMBED_OPERATOR_METRICS_FROM": json.dumps([MONITORING], separators=(",", ":")),
}


def preview(source: str | Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kembed_operator.preview`` as `make operator-dev` installs it, the file given or its text on stdin."""
    given = str(source) if isinstance(source, Path) else "-"
    text = None if isinstance(source, Path) else source
    environ = {**os.environ, **(env or {})}
    return run_with_only(
        OPERATOR_DEV, "-m", "kembed_operator.preview", *flags, given, cwd=ROOT, env=environ, stdin=text
    )


def section(title: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"### {title}\n")
    return text[start : text.index("\n#", start + 1)]


def documented_previews() -> list[tuple[dict[str, str], list[str]]]:
    """(variables, arguments) of each preview command the section gives, continuation lines joined."""
    joined = section("Check it offline").replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        if PREVIEW in line:
            words = shlex.split(line)
            at = words.index("-m") + 2
            variables = dict(word.split("=", 1) for word in words[: at - 3])
            commands.append((variables, words[at:]))
    return commands


def front_page_service() -> dict[str, Any]:
    heredoc = re.search(r"<<'YAML'\n(.*?)\nYAML\n", (ROOT / "README.md").read_text(), re.S)
    assert heredoc is not None
    return dict(yaml.safe_load(heredoc.group(1)))


def warnings(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning: ")]


@pytest.mark.process
def test_the_documented_commands_render_the_chart_example_and_every_child_validates() -> None:
    (plain_env, plain), (installed_env, installed) = documented_previews()
    result = preview(ROOT / plain[-1], *plain[:-1], env=plain_env)
    assert result.returncode == 0, result.stderr
    assert [doc["kind"] for doc in yaml.safe_load_all(result.stdout)] == SERVICE_KINDS
    assert {doc["metadata"]["namespace"] for doc in yaml.safe_load_all(result.stdout)} == {"search"}  # -n's
    (image,) = warnings(result)  # the example names its metricsFrom
    assert UNPUBLISHED_IMAGE in image and "not published" in image
    # With the install's settings (those the chart passes the operator) the strict check is clean.
    assert installed_env == INSTALLED
    strict = preview(ROOT / installed[-1], *installed[:-1], env=installed_env)
    assert "--strict" in installed and strict.returncode == 0 and warnings(strict) == [], strict.stderr
    assert strict.stdout == result.stdout.replace(UNPUBLISHED_IMAGE, INSTALLED["KEMBED_OPERATOR_DEFAULT_IMAGE"])


def test_the_documented_settings_are_those_the_documented_install_passes_the_operator() -> None:
    from tests.operator.conftest import render_chart

    where, values = next(install for install in documented_installs() if install[0].startswith("docs/operator.md"))
    (deployment,) = [d for d in render_chart(values) if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {name: env[name] for name in INSTALLED} == INSTALLED, where


@pytest.mark.process
def test_the_front_pages_service_is_flagged_until_the_operator_has_an_image_and_metrics_peers() -> None:
    service = front_page_service()
    result = preview(yaml.safe_dump(service), "-n", "search")
    assert result.returncode == 0, result.stderr
    assert [doc["kind"] for doc in yaml.safe_load_all(result.stdout)] == SERVICE_KINDS
    image, metrics = warnings(result)
    assert image.startswith("warning: EmbeddingService search/bge-small: ") and UNPUBLISHED_IMAGE in image
    assert NO_METRICS in metrics and "autoscaler" in metrics and "KEMBED_OPERATOR_METRICS_FROM" in metrics
    strict = preview(yaml.safe_dump(service), "-n", "search", "--strict")
    assert strict.returncode == 1 and strict.stdout == result.stdout and warnings(strict) == [image, metrics]
    assert preview(yaml.safe_dump(service), "--strict", env=INSTALLED).returncode == 0


@pytest.mark.process
def test_a_job_renders_with_its_service_and_warns_of_its_image() -> None:
    service = front_page_service()
    job = yaml.safe_load((EXAMPLES / "embeddingjob.yaml").read_text())
    job["spec"]["service"] = service["metadata"]["name"]
    result = preview(yaml.safe_dump_all([service, job]), env={"KEMBED_OPERATOR_METRICS_FROM": "[]"})
    assert result.returncode == 0, result.stderr
    assert [doc["kind"] for doc in yaml.safe_load_all(result.stdout)][-1] == "Job"
    assert [w.split(":")[1].strip() for w in warnings(result)] == [
        "EmbeddingService default/bge-small",  # its image
        "EmbeddingService default/bge-small",  # its metrics
        "EmbeddingJob default/wiki",  # its image: the service's, the operator's default
    ]
    job["spec"]["image"] = "registry.example/kembed-server:1"
    own_image = preview(yaml.safe_dump_all([service, job]))
    assert not any("EmbeddingJob" in w for w in warnings(own_image))


@pytest.mark.process
def test_a_resource_in_another_namespace_than_ns_is_refused_as_kubectl_refuses_it() -> None:
    service = {**front_page_service(), "metadata": {"name": "bge-small", "namespace": "ranking"}}
    result = preview(yaml.safe_dump(service), "-n", "search")
    assert result.returncode == 1 and result.stdout == ""
    assert "EmbeddingService ranking/bge-small: its namespace is not -n's ('search'): give -n ranking" in result.stderr
    assert preview(yaml.safe_dump(service), "-n", "ranking").returncode == 0


@pytest.mark.process
def test_what_the_operator_refuses_is_named_and_exits_1() -> None:
    service = yaml.safe_load((EXAMPLES / "embeddingservice.yaml").read_text())
    service["spec"]["slo"] = {"p95LatencyMs": -5}
    result = preview(yaml.safe_dump(service))
    assert result.returncode == 1 and result.stdout == ""
    assert "spec.slo.p95LatencyMs" in result.stderr and "Traceback" not in result.stderr
    job = yaml.safe_load((EXAMPLES / "embeddingjob.yaml").read_text())
    orphan = preview(yaml.safe_dump(job))
    assert orphan.returncode == 1 and "is not in the file" in orphan.stderr


@pytest.mark.process
def test_the_documented_chart_snippet_prints_what_it_rendered(tmp_path: Path) -> None:
    (snippet,) = re.findall(r"```python\n(.*?)```", section("Check it offline"), re.S)
    (tmp_path / "snippet.py").write_text(snippet)
    result = run_with_only(OPERATOR_DEV, "file", str(tmp_path / "snippet.py"), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    printed = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= {doc["kind"] for doc in printed}
    assert result.stdout.count("# Source: ") == len(printed)


def test_the_section_names_the_install_these_run_with() -> None:
    assert "\nmake operator-dev\n" in section("Check it offline")
