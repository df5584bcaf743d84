"""Which HTTP stack for the REST edge: the rounds, the probes and the README block
(``python -m bench.edges.http_stacks``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.edges import http_stacks  # the package's docstring is the command's help
from bench.edges.http_edges import candidates, process
from bench.edges.http_stacks.load import one_round
from bench.edges.http_stacks.probes import probes
from bench.edges.http_stacks.servers import Options
from bench.edges.http_stacks.summary import kembed_work_ms, summarize, table
from bench.tools import machine
from bench.tools.report import splice

README = Path(__file__).resolve().parents[2] / "README.md"
MARKERS = ("<!-- bench:http_stacks:begin -->", "<!-- bench:http_stacks:end -->")


def run(opts: Options) -> dict[str, Any]:
    print(f"http_stacks: {', '.join(opts.stacks)}; {opts.repeats} rounds; load average {os.getloadavg()[0]:.2f}")
    rounds = [one_round(opts, i) for i in range(opts.repeats)]
    work = kembed_work_ms()
    result: dict[str, Any] = {
        "settings": asdict(opts),
        "versions": _versions(),
        "kembed_work": work,
        "rounds": rounds,
        "summary": summarize(rounds, work["ms"] if work else None),
    }
    if opts.probes:
        result["probes"] = {s: probes(s) for s in opts.stacks if s != process.GRPC}
    path = machine.write_result(opts.name, result)
    result = json.loads(path.read_text())  # with the machine's description
    block = table(result)
    README.write_text(splice(README.read_text(), block, MARKERS))
    print(block)
    return result


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    packages = ("uvicorn", "starlette", "fastapi", "aiohttp", "httptools", "granian", "orjson", "grpcio", "pydantic")
    for package in packages:
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    h2load = subprocess.run(["h2load", "--version"], capture_output=True, text=True, check=False)
    found["h2load"] = h2load.stdout.strip()
    return found


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=http_stacks.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    everything = ",".join([process.GRPC, *candidates.STACKS])
    parser.add_argument("--stacks", default=everything, help=f"comma-separated, of {everything} (grpc always runs)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every stack")
    parser.add_argument("--connections", type=int, default=16, help="keep-alive connections, 1 call in flight each")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measured load")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each measured one")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds each server idles before its loads")
    parser.add_argument("--no-probes", dest="probes", action="store_false", help="skip the robustness probes")
    parser.add_argument("--name", default="http_stacks", help="write bench/results/NAME.json")
    args = parser.parse_args(argv)
    stacks = [s for s in args.stacks.split(",") if s]
    if unknown := set(stacks) - {process.GRPC, *candidates.STACKS}:
        parser.error(f"unknown stacks: {', '.join(sorted(unknown))}")
    ordered = (process.GRPC, *(s for s in candidates.STACKS if s in stacks))  # the yardstick first
    return run(Options(**{**vars(args), "stacks": ordered}))
