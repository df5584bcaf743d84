"""The Dockerfiles, without a Docker engine: they parse, copy what exists, run CI's install commands,
name entrypoints that exist, and never run as root."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kembed.config import Settings
from kembed.contract import GRPC_PORT, HTTP_PORT, LIVEZ_PATH
from kembed_operator.job_spec import OUTPUT_FORMATS

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTIONS = {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "EXPOSE", "USER", "HEALTHCHECK", "ENTRYPOINT", "CMD"}
Instruction = tuple[str, str]


def parse(name: str) -> list[Instruction]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, pending = [], ""
    for line in (ROOT / name).read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    assert not pending, "a dangling line continuation"
    parsed = [(text.split(None, 1)[0], text.split(None, 1)[1]) for text in logical]
    assert {kind for kind, _ in parsed} <= INSTRUCTIONS
    assert parsed[0][0] == "FROM"
    return parsed


def args(instructions: list[Instruction], kind: str) -> list[str]:
    return [rest for k, rest in instructions if k == kind]


def exec_form(instructions: list[Instruction], kind: str) -> list[str]:
    (value,) = args(instructions, kind)
    return list(json.loads(value))


def run_commands(instructions: list[Instruction]) -> list[str]:
    return [cmd.strip() for run in args(instructions, "RUN") for cmd in run.split("&&")]


def makefile_command(pattern: str) -> str:
    """A command from the Makefile (what CI runs), continuation lines joined, variables resolved."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    torch = re.search(r"^TORCH\s*:=\s*(\S+)", text, re.M)
    assert torch is not None
    match = re.search(pattern, text.replace("$(TORCH)", torch.group(1)).replace("$(BIN)/", ""))
    assert match is not None, pattern
    return " ".join(match.group(0).split())


DOCKERFILES = ["Dockerfile.server", "Dockerfile.operator"]
# The server, and Parquet for the corpus command: an EmbeddingJob runs in the server image by default.
SERVER_INSTALL = 'pip install ".[server,parquet]"'


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copies_exist_and_user_is_not_root(name: str) -> None:
    instructions = parse(name)
    for copy in args(instructions, "COPY"):
        *sources, _ = shlex.split(copy)
        assert all((ROOT / source).exists() for source in sources), copy
    users = args(instructions, "USER")
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and int(user) >= 1000
    assert f"--uid {user}" in " ".join(args(instructions, "RUN"))
    # USER comes after every RUN: nothing after it could need root.
    kinds = [kind for kind, _ in instructions]
    assert kinds.index("USER") > max(i for i, kind in enumerate(kinds) if kind == "RUN")


def test_server_installs_as_ci_does() -> None:
    commands = run_commands(parse("Dockerfile.server"))
    torch = makefile_command(r'pip install -q "torch==[^"]+"').replace(" -q", "")
    protoc = makefile_command(r"python -m grpc_tools\.protoc [^\n]+?embedder\.proto")
    assert commands.index(torch) < commands.index(protoc) < commands.index(SERVER_INSTALL)
    pyproject = (ROOT / "pyproject.toml").read_text()
    tools = next(c for c in commands if "grpcio-tools" in c)
    assert tools.split('"')[1] in pyproject  # the [proto] extra's own pin


def test_the_server_image_writes_every_format_a_corpus_job_may_ask_for() -> None:
    """.npy and JSONL need nothing beyond the server's packages; Parquet needs the [parquet] extra."""
    assert set(OUTPUT_FORMATS.values()) == {"npy", "jsonl", "parquet"}
    assert SERVER_INSTALL in run_commands(parse("Dockerfile.server"))
    assert "parquet = [" in (ROOT / "pyproject.toml").read_text()


def test_server_has_the_compiler_and_headers_torch_compile_needs_at_run_time() -> None:
    """Triton builds C launchers that include Python.h whenever inductor compiles for CUDA, and a CUDA
    runtime image has neither a compiler nor the headers (pytorch#116696): warmup would fail."""
    commands = run_commands(parse("Dockerfile.server"))
    install = next(command for command in commands if command.startswith("apt-get install"))
    assert {"python3-dev", "gcc", "g++", "libc6-dev"} <= set(install.split())
    probe = next(index for index, command in enumerate(commands) if command.startswith("gcc "))
    assert commands.index("python3 -m venv /opt/venv") < probe < commands.index(SERVER_INSTALL)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler on this machine")
def test_the_server_images_compiler_probe_is_a_working_command(tmp_path: Path) -> None:
    """The probe the image build runs, run here with this interpreter standing in for the venv's."""
    (probe,) = [run for run in args(parse("Dockerfile.server"), "RUN") if "probe.c" in run]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["sh", "-c", probe.replace("/tmp/probe", str(tmp_path / "probe"))], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_server_runs_the_server_on_the_contract() -> None:
    instructions = parse("Dockerfile.server")
    assert exec_form(instructions, "ENTRYPOINT") == ["python", "-m", "kembed"]
    assert (ROOT / "server" / "kembed" / "__main__.py").exists()
    env = " ".join(args(instructions, "ENV"))
    assert "KEMBED_GRPC_HOST=0.0.0.0" in env and "KEMBED_HTTP_HOST=0.0.0.0" in env
    kembed_env = dict(pair.split("=", 1) for pair in env.split() if pair.startswith("KEMBED_"))
    Settings.from_env(kembed_env)  # names and values the server accepts
    assert args(instructions, "EXPOSE") == [f"{GRPC_PORT} {HTTP_PORT}"]
    healthcheck = args(instructions, "HEALTHCHECK")[0]
    assert f"http://127.0.0.1:{HTTP_PORT}{LIVEZ_PATH}" in healthcheck


def test_operator_image() -> None:
    instructions = parse("Dockerfile.operator")
    assert args(instructions, "FROM")[0].startswith("python:3.11-slim")
    assert 'pip install ".[operator]"' in run_commands(instructions)
    assert "torch" not in " ".join(args(instructions, "RUN"))
    assert exec_form(instructions, "ENTRYPOINT") == ["kopf"]
    command = exec_form(instructions, "CMD")
    module = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--module="))
    assert importlib.util.find_spec(module) is not None
    assert importlib.util.find_spec("kopf") is not None


def test_the_operator_imports_nothing_its_image_lacks() -> None:
    """The operator image has the kembed package without the server's extras: importing the operator
    (its use of kembed.config and kembed.contract included) must not reach torch, numpy or grpc."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'numpy', 'grpc', 'transformers', 'tokenizers'):\n"
        "            raise ImportError('the operator image has no ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kembed_operator.handlers, kembed_operator.crd\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
