"""The layout is the architecture: three process roles, each a package (the supervisor, the front
ends, the engine), that talk only through the protocol (kembed.ipc.protocol, kembed.ipc.board) and the
runtime folder, so no side imports another, and the modules they share import none; within a front
end, only the gRPC edge knows the proto (the service and the other edges speak the domain's call).
Read from the source, so a new import that crosses shows up here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "server" / "kembed"
SIDES = ("supervisor", "frontend", "engine")
# What the sides share, by kind: each group, and each settings module at the root, may import these
# of kembed besides itself (bottom up: contract, domain, config, policy, ipc and plumbing, metrics).
MAY_IMPORT = {
    "contract": set(),  # names, ports, paths: what the client, the operator and the server agree on
    "domain": set(),  # a request's values: inputs, prompts, texts, failures
    "config": {"contract", "domain"},  # the settings, from KEMBED_*
    "policy": {"contract", "config", "domain"},  # the rules both sides apply, pure
    "ipc": {"contract", "domain", "policy"},  # the frames and the board
    "plumbing": {"contract", "config"},  # what a process needs of its host
    "metrics": {"contract", "ipc", "policy"},  # each process's Prometheus metrics
}
GROUPS = ("domain", "policy", "ipc", "plumbing", "config")  # packages
SETTINGS = ("contract", "metrics")  # modules at the root, beside config/
MAX_LINES = 450  # a module longer than this holds more than one thing to read
# The supervisor starts the other processes by module name: it imports neither side.
# ``python -m kembed`` (__main__.py) is the supervisor's entry point: the one root module above a side.
SHARED = sorted(
    [*(PACKAGE / f"{name}.py" for name in SETTINGS), *(p for group in GROUPS for p in (PACKAGE / group).rglob("*.py"))]
)
PROTO = "kembed.v1"  # the generated protobuf code


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, resolved to absolute names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def crossings(path: Path, forbidden: list[str]) -> list[str]:
    return sorted(name for name in imported(path) for side in forbidden if name.startswith(f"kembed.{side}"))


@pytest.mark.parametrize("side", SIDES)
def test_a_side_never_imports_the_other(side: str) -> None:
    other = [s for s in SIDES if s != side]
    found = {str(p.relative_to(PACKAGE)): crossings(p, other) for p in (PACKAGE / side).rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}
    assert found, f"no modules under {side}/"


def test_shared_modules_import_no_side() -> None:
    found = {str(p.relative_to(PACKAGE)): crossings(p, [*SIDES, "client"]) for p in SHARED}
    assert {name: names for name, names in found.items() if names} == {}
    assert len(found) > len(GROUPS) + len(SETTINGS)


def test_no_module_is_over_450_lines() -> None:
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES and "/v1/" not in f"/{path}"} == {}


def test_only_the_entry_points_and_the_settings_lie_loose_at_the_root() -> None:
    """The rest is in a package: a process role, a group of what they share, the client, the proto."""
    loose = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert loose == set(SETTINGS)
    assert packages == {*SIDES, *GROUPS, "client", "v1"}


def group_of(name: str) -> str | None:
    """The group or settings module a kembed module name lies in (``kembed.ipc.board``: ipc)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kembed" else None


@pytest.mark.parametrize("kind", sorted(MAY_IMPORT))
def test_a_group_imports_only_the_groups_below_it(kind: str) -> None:
    paths = sorted((PACKAGE / kind).rglob("*.py")) if kind in GROUPS else [PACKAGE / f"{kind}.py"]
    allowed = {None, kind, *MAY_IMPORT[kind]}
    found = {str(p.relative_to(PACKAGE)): {group_of(name) for name in imported(p)} - allowed for p in paths}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_groups_below_hold_no_circle() -> None:
    """Read as a graph of kinds, what :data:`MAY_IMPORT` allows has no cycle: a bottom exists."""
    left = dict(MAY_IMPORT)
    while left:
        bottom = [kind for kind, below in left.items() if not below & set(left)]
        assert bottom, f"a circle among {sorted(left)}"
        for kind in bottom:
            del left[kind]


def imports(path: Path, module: str) -> bool:
    """Whether ``path`` imports ``module`` or anything in it."""
    return any(name == module or name.startswith(module + ".") for name in imported(path))


def test_only_the_grpc_edge_of_a_front_end_imports_the_proto() -> None:
    found = [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "frontend").rglob("*.py")) if imports(p, PROTO)]
    assert found == ["frontend/grpc_api.py", "frontend/grpc_messages.py"]


def test_the_check_sees_a_crossing(tmp_path: Path) -> None:
    module = tmp_path / "crossing.py"
    module.write_text("from kembed.engine.buckets import route\nimport kembed.frontend.link\n")
    assert crossings(module, list(SIDES)) == [
        "kembed.engine.buckets",
        "kembed.engine.buckets.route",
        "kembed.frontend.link",
    ]


def test_the_check_sees_an_import_of_the_proto(tmp_path: Path) -> None:
    found = {}
    for name, source in {
        "from_package": "from kembed import v1\n",
        "from_module": "from kembed.v1.embedder_pb2 import EmbedRequest\n",
        "plain": "import kembed.v1.embedder_pb2_grpc\n",
        "a_lookalike": "import kembed.v1x\nfrom kembed.frontend import call\n",
    }.items():
        module = tmp_path / f"{name}.py"
        module.write_text(source)
        found[name] = imports(module, PROTO)
    assert found == {"from_package": True, "from_module": True, "plain": True, "a_lookalike": False}


def test_the_group_check_reads_each_import_as_its_group(tmp_path: Path) -> None:
    module = tmp_path / "above.py"
    module.write_text("from kembed.ipc.board import Board\nfrom kembed import metrics\nimport numpy\n")
    assert {group_of(name) for name in imported(module)} == {"ipc", "metrics", None}
