"""The offline check docs/operator.md gives, run as written: the preview command on the chart's
examples and the front page's EmbeddingService, and the chart's render-and-validate snippet."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operator.md"
EXAMPLES = ROOT / "charts" / "kembed-operator" / "examples"


def preview(source: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m kembed_operator.preview``, the file given or its text on stdin."""
    given = str(source) if isinstance(source, Path) else "-"
    text = None if isinstance(source, Path) else source
    command = [sys.executable, "-m", "kembed_operator.preview", given]
    return subprocess.run(command, input=text, capture_output=True, text=True, timeout=120, cwd=ROOT)


def section(title: str) -> str:
    text = GUIDE.read_text()
    start = text.index(f"### {title}\n")
    return text[start : text.index("\n#", start + 1)]


def test_the_documented_command_renders_the_chart_example_and_every_child_validates() -> None:
    (command,) = re.findall(r"^\.venv/bin/python -m kembed_operator\.preview (\S+)$", section("Check it offline"), re.M)
    result = preview(ROOT / command)
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout)]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler"]


def test_a_job_renders_with_its_service_and_the_front_pages_service_is_valid() -> None:
    heredoc = re.search(r"<<'YAML'\n(.*?)\nYAML\n", (ROOT / "README.md").read_text(), re.S)
    assert heredoc is not None
    service = yaml.safe_load(heredoc.group(1))
    job = yaml.safe_load((EXAMPLES / "embeddingjob.yaml").read_text())
    job["spec"]["service"] = service["metadata"]["name"]
    result = preview(yaml.safe_dump_all([service, job]))
    assert result.returncode == 0, result.stderr
    assert [doc["kind"] for doc in yaml.safe_load_all(result.stdout)][-1] == "Job"


def test_what_the_operator_refuses_is_named_and_exits_1() -> None:
    service = yaml.safe_load((EXAMPLES / "embeddingservice.yaml").read_text())
    service["spec"]["slo"] = {"p95LatencyMs": -5}
    result = preview(yaml.safe_dump(service))
    assert result.returncode == 1 and result.stdout == ""
    assert "spec.slo.p95LatencyMs" in result.stderr and "Traceback" not in result.stderr
    job = yaml.safe_load((EXAMPLES / "embeddingjob.yaml").read_text())
    orphan = preview(yaml.safe_dump(job))
    assert orphan.returncode == 1 and "is not in the file" in orphan.stderr


def test_the_documented_chart_snippet_runs() -> None:
    (snippet,) = re.findall(r"```python\n(.*?)```", section("Check it offline"), re.S)
    subprocess.run([sys.executable, "-c", snippet], check=True, cwd=ROOT, timeout=120)
