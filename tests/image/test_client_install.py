"""``pip install 'kembed[client]'`` in a fresh venv: the client's extra (numpy, grpcio, protobuf,
tqdm) is all it needs, no torch. Run with the images (``make image-test``): like them, it installs
the package from the configured index, a minute or more of pip on two cores that ``make test``
leaves out. ``tests/server/test_imports.py`` reads the same from the source in ``make unit``: the
client imports nothing of the server's."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SERVER = ROOT / "server"

pytestmark = [pytest.mark.image, pytest.mark.process, pytest.mark.timeout(1200)]


def test_the_client_extra_installs_and_runs_without_torch(tmp_path: Path) -> None:
    """A fresh venv, ``pip install '.[client]'`` (from the configured index, offline-capable), then
    the CLI's help and the library's import, with no torch anywhere."""
    if not (SERVER / "kembed" / "v1" / "embedder_pb2.py").exists():
        pytest.skip("make proto first: the generated code ships in the package")
    project = tmp_path / "project"  # a clean copy: setuptools would pack whatever an old build/ holds
    for folder in ("server", "operator"):
        shutil.copytree(ROOT / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, project / file)
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = str(env / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", f"{project}[client]"], capture_output=True, text=True, timeout=900
    )
    assert install.returncode == 0, install.stdout + install.stderr
    check = "import importlib.util as u; from kembed.client import EmbedClient; assert u.find_spec('torch') is None"
    subprocess.run([python, "-c", check], cwd=tmp_path, check=True, timeout=120)
    for argv in (["--help"], ["embed", "--help"]):
        shown = subprocess.run(
            [python, "-m", "kembed.client", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert shown.returncode == 0, shown.stderr
        assert "--target" in shown.stdout
