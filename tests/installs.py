"""A command run as if only what a role's install brings were installed.

``make client`` and ``make operator-dev`` install extras of kembed into .venv; a fresh venv for each
would take minutes of downloads in a test, so the test venv (which has every extra) hides the rest:
the distributions that installing kembed with the target's extras brings (its requirements, followed
through theirs, read from the installed metadata) stay importable, every other third-party module
is refused as if absent. An optional import (grpc's of grpc_tools, openai's of aiohttp) then falls
back as it would in the role's venv, and a missing requirement fails the command.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"
# Refuses the modules named in argv[1] (comma-separated top-level names), then runs a module (-m)
# or a file as __main__ with the arguments after it.
_PROBE = """
import importlib.abc, runpy, sys
absent = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r} (the role's install has none)", name=name)
        return None
sys.meta_path.insert(0, Absent())
kind, target, *args = sys.argv[2:]
sys.argv = [target, *args]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


def target_extras(stamp: str) -> set[str]:
    """The extras the Makefile's recipe for ``.venv/.STAMP`` installs kembed with."""
    recipe = re.search(rf"^\$\(VENV\)/\.{re.escape(stamp)}:.*\n((?:\t.*\n)+)", MAKEFILE.read_text(), re.M)
    assert recipe is not None, f"no recipe for .venv/.{stamp} in the Makefile"
    groups = re.findall(r'-e "\.\[([\w,-]+)\]"', recipe.group(1))
    return {extra for group in groups for extra in group.split(",")}


def installed_by(extras: Iterable[str]) -> set[str]:
    """The distributions (canonical names) that installing kembed with ``extras`` brings, kembed included."""
    found: set[str] = set()
    todo = [("kembed", extra) for extra in ("", *extras)]
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        found.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:  # a requirement of another platform than this one
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                dependency = canonicalize_name(requirement.name)
                todo += [(dependency, wanted) for wanted in ("", *requirement.extras)]
    return found


def run_with_only(
    extras: Iterable[str],
    kind: str,
    target: str,
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m TARGET ARGS`` (``kind`` "-m") or ``python FILE ARGS`` (``kind`` "file"), every
    third-party module refused that installing kembed with ``extras`` would not bring."""
    command = [sys.executable, "-c", _PROBE, _absent(frozenset(extras)), kind, target, *args]
    return subprocess.run(command, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=300)


@functools.cache
def _absent(extras: frozenset[str]) -> str:
    """The top-level modules no distribution installing kembed with ``extras`` brings, comma-separated."""
    installed = installed_by(extras)
    return ",".join(
        sorted(
            module
            for module, distributions in metadata.packages_distributions().items()
            # A namespace package (google) comes from several distributions: any of them will do.
            if not {canonicalize_name(d) for d in distributions} & installed
        )
    )
