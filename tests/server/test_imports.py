"""The import graph of ``server/kembed``, read from the source: no module takes part in an import
cycle, and the client (``kembed.client``) reaches nothing of the server's, so that
``pip install 'kembed[client]'`` (numpy, grpcio, protobuf, tqdm: no torch) is all it needs.
tests/image/test_client_install.py installs it so in a fresh venv (`make image-test`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SERVER = ROOT / "server"
# What the client may import besides the standard library: the `client` extra's packages (and
# pyarrow, the `parquet` extra, for Parquet output), and the modules of kembed it shares.
CLIENT_PACKAGES = {"grpc", "numpy", "google", "tqdm", "pyarrow"}
CLIENT_SHARED = {
    "kembed",
    "kembed.contract",
    "kembed.domain",
    "kembed.domain.texts",
    "kembed.v1",
    "kembed.v1.embedder_pb2",
    "kembed.v1.embedder_pb2_grpc",
}
# The server's, which a client must never load (checked in a process that imports the client).
SERVER_ONLY = ["torch", "transformers", "tokenizers", "safetensors", "pydantic", "kembed.config", "kembed.frontend"]

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path = SERVER) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = SERVER) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / "kembed").rglob("*.py"))}


def imports(path: Path, name: str) -> Iterator[tuple[str, str | None]]:
    """``(module, name)`` for each import that runs when the module is loaded: ``from m import n``
    gives ``(m, n)``, ``import m`` gives ``(m, None)``. Imports under ``if TYPE_CHECKING:`` never run."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield from ((base, alias.name) for alias in node.names)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def resolve(module: str, name: str | None, known: set[str]) -> str:
    """The module an import loads: ``from m import n`` is the submodule ``m.n`` when there is one."""
    if name is not None and f"{module}.{name}" in known:
        return f"{module}.{name}"
    return module


def graph(root: Path = SERVER) -> Graph:
    """Each kembed module's edges to the kembed modules it imports."""
    found = modules(root)
    known = set(found)
    edges: Graph = {}
    for name, path in found.items():
        targets = {resolve(module, alias, known) for module, alias in imports(path, name)}
        edges[name] = {target for target in targets if target in known and target != name}
    return edges


def cycles(edges: Graph) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_cycle_in(node, component, edges))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _cycle_in(start: str, component: set[str], edges: Graph) -> list[str]:
    """A path from ``start`` back to itself inside its component (breadth first: the shortest)."""
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for target in sorted(edges[path[-1]] & component):
            if target == start:
                return [*path, start]
            if target not in path:
                paths.append([*path, target])
    raise AssertionError(f"no cycle through {start}")


def reached(start: set[str], edges: Graph) -> set[str]:
    """Every kembed module loaded with ``start``: what they import, and the packages around each."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)]
        todo.extend([*edges.get(name, ()), *parents])
    return seen


def outside_imports(names: set[str], root: Path = SERVER) -> dict[str, set[str]]:
    """The top-level packages, outside kembed and the standard library, each module imports."""
    found = modules(root)
    return {
        name: {
            module.split(".")[0]
            for module, _ in imports(found[name], name)
            if module.split(".")[0] not in {"kembed", "__future__", *sys.stdlib_module_names}
        }
        for name in names
    }


def test_no_module_takes_part_in_an_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_cycle_check_finds_a_cycle_and_names_it(tmp_path: Path) -> None:
    package = tmp_path / "kembed"
    (package / "client").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "client" / "__init__.py").write_text("from kembed.client.job import run\n")
    (package / "client" / "job.py").write_text("from kembed.client import options\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kembed import typed2\n"
    )
    (package / "typed2.py").write_text("from . import typed\n")  # relative, and only typed back
    assert cycles(graph(tmp_path)) == [["kembed.client", "kembed.client.job", "kembed.client"]]


def test_the_client_reaches_only_its_own_modules_and_the_shared_ones() -> None:
    client = {name for name in modules() if name == "kembed.client" or name.startswith("kembed.client.")}
    loaded = reached(client, graph())
    assert loaded - client == CLIENT_SHARED
    packages = outside_imports(loaded)
    assert {name: found - CLIENT_PACKAGES for name, found in packages.items() if found - CLIENT_PACKAGES} == {}
    assert set().union(*packages.values()) == CLIENT_PACKAGES  # the check sees them all


@pytest.mark.process
def test_loading_the_client_loads_nothing_of_the_servers() -> None:
    script = (
        "import sys, kembed.client, kembed.client.__main__, kembed.client.corpus.command\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_ONLY!r} or m in {SERVER_ONLY!r}))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def floors(edges: Graph, package: str) -> list[str]:
    """The longest chain of imports among ``package``'s modules (its floors, top first): how far a
    reader descends from its entry point to the module that imports none of its siblings."""
    inside = {name: {t for t in targets if t.startswith(package + ".")} for name, targets in edges.items()}
    inside = {name: targets for name, targets in inside.items() if name.startswith(package + ".")}
    below: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in below:
            below[name] = [name, *max((chain(t) for t in sorted(inside[name])), key=len, default=[])]
        return below[name]

    return max((chain(name) for name in sorted(inside)), key=len, default=[])


def test_the_engine_is_at_most_eight_floors_high() -> None:
    """Its stages import each other to call, never for a type (those live in engine/units.py)."""
    chain = floors(graph(), "kembed.engine")
    assert len(chain) <= 8, " -> ".join(chain)


def test_floors_counts_the_longest_chain() -> None:
    edges: Graph = {"p.a": {"p.b", "p.c"}, "p.b": {"p.c", "q.x"}, "p.c": set(), "q.x": set()}
    assert floors(edges, "p") == ["p.a", "p.b", "p.c"]
