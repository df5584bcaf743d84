"""The bench's layout: rooms by question (``compute``, ``serving``, ``edges``, ``fleet``), each
importing only the shared tools (``bench.tools``), the headline's ratios (``bench.headline``) and
itself; the tools import no benchmark and the headline only the tools; ``bench.run_all`` and
``bench.plot`` at the top may import anything. No import circle, no file over 400 lines and no
function over 80. Read from the source, so a new import that crosses shows up here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"
ROOMS = ("compute", "serving", "edges", "fleet")
ROOT = "root"  # bench/__init__.py: RESULTS_DIR, imports nothing of the bench
TOP = "top"  # bench/run_all.py and bench/plot.py: they run and report every room
# What each layer may import inside the bench (besides itself).
ALLOWED = {"tools": {ROOT}, "headline": {ROOT, "tools"}, **{room: {ROOT, "tools", "headline"} for room in ROOMS}}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def edges(path: Path, known: set[str]) -> set[str]:
    """The bench modules ``path`` imports (at the top or inside a function), resolved to the module
    named: ``from bench.x import y`` is ``bench.x.y`` where that is a module, else ``bench.x``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT
    return parts[1] if parts[1] in (*ROOMS, "tools", "headline") else TOP


def graph(root: Path) -> dict[str, set[str]]:
    found = modules(root)
    return {name: edges(path, set(found)) - {name} for name, path in found.items()}


def against_the_arrows(imports: dict[str, set[str]]) -> dict[str, list[str]]:
    crossing = {}
    for module, targets in imports.items():
        own = layer(module)
        if own == TOP:
            continue
        wrong = sorted(t for t in targets if layer(t) != own and layer(t) not in ALLOWED.get(own, set()))
        if wrong:
            crossing[module] = wrong
    return crossing


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each once, as the path that closes it (depth first)."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append([*path[path.index(module) :], module])
            return
        if module in done:
            return
        for target in sorted(imports.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(imports):
        visit(module, [])
    return found


def test_every_room_is_there() -> None:
    layers = {layer(name) for name in modules(BENCH)}
    assert layers == {ROOT, TOP, "tools", "headline", *ROOMS}


def test_no_import_against_the_arrows() -> None:
    """The tools import no benchmark; the headline only the tools; a room no other room, nor the top."""
    assert against_the_arrows(graph(BENCH)) == {}


def test_no_import_circle() -> None:
    assert circles(graph(BENCH)) == []


def test_no_file_over_400_lines() -> None:
    lengths = {str(p.relative_to(BENCH)): len(p.read_text().splitlines()) for p in BENCH.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MAX_FILE_LINES} == {}


def test_no_function_over_80_lines() -> None:
    long = {}
    for path in BENCH.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(BENCH)}:{node.name}"] = lines
    assert long == {}


@pytest.fixture
def small_bench(tmp_path: Path) -> Path:
    """A bench with a tool that imports a room, a room that imports another, and a circle."""
    root = tmp_path / "bench"
    sources = {
        "__init__.py": "",
        "tools/__init__.py": "",
        "tools/load.py": "from bench.serving import hostpath\n",
        "serving/__init__.py": "",
        "serving/hostpath.py": "from bench.tools import load\nfrom bench import RESULTS_DIR\n",
        "fleet/__init__.py": "",
        "fleet/run.py": "def main():\n    from bench.serving.hostpath import encode\n",
        "run_all.py": "from bench.fleet import run\nfrom bench.serving import hostpath\n",
    }
    for name, source in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


def test_the_check_sees_a_crossing_and_a_circle(small_bench: Path) -> None:
    imports = graph(small_bench)
    assert imports["bench.serving.hostpath"] == {"bench", "bench.tools.load"}
    assert against_the_arrows(imports) == {
        "bench.tools.load": ["bench.serving.hostpath"],
        "bench.fleet.run": ["bench.serving.hostpath"],
    }
    assert circles(imports) == [["bench.serving.hostpath", "bench.tools.load", "bench.serving.hostpath"]]
