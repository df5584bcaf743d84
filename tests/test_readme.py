"""The front page's examples, run as written against a real server.

Every fenced block of README.md is either run here (its addresses mapped to a test server's, which
serves the prompts the README gives it) or checked where it is said below: a block nobody runs
fails this test. ``make`` lines start the server this fixture starts; ``helm install`` is rendered
and validated in tests/operator/test_chart.py, the EmbeddingService it applies in
tests/operator/test_preview.py. The Python blocks run with only what ``make client``, which the
README names for them, installs (tests/installs.py)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.installs import run_with_only, target_extras
from tests.server.serving import PLAIN, ServerProcess, the_plain_server

ROOT = Path(__file__).resolve().parents[1]
FRONT_PAGE = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
CHECKED_ELSEWHERE = {"make", "helm", "kubectl"}  # what the lines this test does not run run
SERVICE_HOST = "bge-small.search.svc.cluster.local"  # the in-cluster example's Service


def blocks(language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(FRONT_PAGE) if lang == language]


def readme_prompts() -> str:
    """The KEMBED_PROMPTS the front page serves with."""
    (value,) = re.findall(r"^KEMBED_PROMPTS='(.+?)' make serve$", FRONT_PAGE, re.M)
    return value


server = the_plain_server()  # it serves the README's prompts: see the first test


def localized(code: str, server: ServerProcess) -> str:
    """``code`` with the README's addresses mapped to the test server's ports."""
    for host in ("127.0.0.1", SERVICE_HOST):
        code = code.replace(f"{host}:50051", f"127.0.0.1:{server.grpc_port}")
        code = code.replace(f"{host}:8080", f"127.0.0.1:{server.rest_port}")
        code = code.replace(f"{host}:8001", f"127.0.0.1:{server.http_port}")
    return code.replace(".venv/bin/python ", f"{shlex.quote(sys.executable)} ")


def commands(code: str) -> list[str]:
    """A shell block's commands, continuation lines joined, those run elsewhere left out."""
    joined = re.sub(r"<<'(\w+)'\n.*?\n\1\n", "\n", code.replace("\\\n", " "), flags=re.S)  # heredocs: kubectl's
    lines = [line.strip() for line in joined.splitlines() if line.strip()]
    return [line for line in lines if program(line) not in CHECKED_ELSEWHERE]


def program(line: str) -> str:
    """What a command line runs, past its variable assignments."""
    words = shlex.split(line, comments=True)
    return next(word for word in words if not re.match(r"[A-Za-z_][A-Za-z0-9_]*=", word))


def test_the_plain_server_serves_the_front_pages_prompts() -> None:
    assert json.loads(readme_prompts()) == json.loads(PLAIN["prompts"])


def test_the_front_page_has_only_blocks_this_test_runs() -> None:
    assert {lang for lang, _ in BLOCK.findall(FRONT_PAGE)} == {"sh", "python"}


@pytest.mark.process
def test_the_python_examples_run_in_order_with_what_make_client_installs(server: ServerProcess, tmp_path: Path) -> None:
    """As a reader runs them: one session, each block after the ones above it, in the .venv that the
    command their section names (`make client`) installs: other modules of the test venv are absent."""
    section = FRONT_PAGE[: FRONT_PAGE.index("```python")].rsplit("\n## ", 1)[1]
    assert "`make client`" in section
    code = localized("\n".join(blocks("python")), server)
    (tmp_path / "examples.py").write_text(code)
    result = run_with_only(target_extras("client"), "file", "examples.py", cwd=tmp_path)
    assert result.returncode == 0, f"{code}\n{result.stderr}"


@pytest.mark.process
def test_the_shell_examples_run(server: ServerProcess, tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("hello world\nembeddings on kubernetes\n")
    ran = []
    for code in blocks("sh"):
        for command in commands(localized(code, server)):
            result = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
            ran.append((command, result.stdout))
    outputs = dict(ran)
    rest = next(out for command, out in ran if "/v1/embeddings" in command)
    assert len(json.loads(rest)["data"][0]["embedding"]) == 384
    assert any("--prompt-name query" in command for command in outputs)  # the prompts' example ran
    assert (tmp_path / "corpus.npy").exists()  # the corpus command's
