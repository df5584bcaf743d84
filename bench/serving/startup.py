"""Ready after start: ``python -m kembed`` with the default settings, from spawn to ``/readyz``.

Each round points ``KEMBED_COMPILE_CACHE_DIR`` at a fresh temporary folder and starts the server
twice: *cold*, with the folder empty (everything compiled), then *warm*, from what the cold start
left there (a restart, or a replica beside a filled cache volume). Each start is stopped once ready.
Per start: seconds to ready, the forward and dtype that serve and why (``/health``), and the
seconds the engine logged for its compile and comparison and for its whole warmup. Run alone: on 2
shared cores a start-up moves with every other process. Writes ``bench/results/startup.json``.

    python -m bench.serving.startup --rounds 2
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import RESULTS_DIR
from bench.tools import machine
from bench.tools.server import running
from kembed.contract import COMPILING

STARTS = ("cold", "warm")
# What the engine logs (kembed.engine.warmup): the CPU compile with its comparison, and the warmup.
LOGGED = {
    "compile_s": re.compile(r"compiled and compared in ([0-9.]+) s"),
    "warmup_s": re.compile(r"warm: \d+ shapes in ([0-9.]+) s"),
}


def logged_seconds(log: str) -> dict[str, float]:
    """The seconds the engine's log gives for its compile and its warmup (those it has)."""
    found = {name: pattern.search(log) for name, pattern in LOGGED.items()}
    return {name: float(match.group(1)) for name, match in found.items() if match}


def start_once(settings: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    """Spawn the server, wait for ``/readyz``, then for the forward it settles on (a CPU compiles
    beside eager serving: ``settled_s`` is when the compiled forward, or eager for good, serves), stop it."""
    started = time.perf_counter()
    with running(settings, log, start_timeout=timeout, settled=False) as server:
        ready_s = time.perf_counter() - started
        health = server.health()
        while COMPILING in str(health.get("forward_reason")) and time.perf_counter() - started < timeout:
            time.sleep(0.5)
            health = server.health()
        settled_s = time.perf_counter() - started
    return {
        "ready_s": ready_s,
        "settled_s": settled_s,
        "forward": health.get("forward"),
        "forward_reason": health.get("forward_reason"),
        "dtype": health.get("dtype"),
        "dtype_reason": health.get("dtype_reason"),
        **logged_seconds(log.read_text(errors="replace")),
    }


def rounds(count: int, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    done = []
    for r in range(count):
        with tempfile.TemporaryDirectory(prefix="kembed-compile-cache-") as cache:
            settings = {"frontends": "auto", **env, "compile_cache_dir": cache}
            starts = {}
            for start in STARTS:
                starts[start] = figures = start_once(settings, RESULTS_DIR / f"startup_{start}.log", timeout)
                print(f"startup, round {r + 1}, {start}: ready in {figures['ready_s']:.1f} s, "
                      f"{figures['forward']} ({figures['forward_reason']})", flush=True)  # fmt: skip
            done.append(starts)
    return done


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="cold and warm pairs, each with a fresh cache")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    parser.add_argument("--env", action="append", default=[], metavar="SETTING=VALUE", help="a non-default setting")
    args = parser.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    result = {"rounds": rounds(args.rounds, env, args.timeout), "settings": {"frontends": "auto", **env}}
    machine.write_result("startup", result)
    return result


if __name__ == "__main__":
    main()
