"""Part ``engine_bound``: the zero-cost server when the engine's event loop, not the front end, is what
limits, as on a GPU host where many front ends feed the engine's one loop.

A small machine cannot have more front-end cores than the engine's loop can serve, so the regime is
made: the engine's threads share the last CPU with ``--engine-spinners`` busy processes (its loop
then gets about 1/(spinners + 1) of that core), while the front end and the client processes run on
the other CPUs. The host-path load (one short text a call) then measures what the engine's loop
lets through: calls/s, CPU per call of the engine and of the front end, and rows per batch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.serving.hostpath.measure import (
    ZERO_COST,
    Options,
    calls_text,
    counter_figures,
    encode,
    frontends_setting,
    grpc_closed_loop,
    log_file,
)
from bench.tools.server import Server, proc_cpu_seconds, process_tree, running

SPIN = "while True: pass"


def engine_bound(opts: Options, short_texts: list[str]) -> dict[str, Any]:
    """The host-path load on one front end, the engine's loop held to a share of one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("  engine-bound: skipped, it needs two CPUs")
        return {"skipped": "fewer than two CPUs"}
    engine_cpu, other_cpus = {cpus[-1]}, set(cpus[:-1])
    settings = frontends_setting(1)
    with (
        running(settings, log_file("engine_bound"), module=ZERO_COST) as server,
        spinning(opts.engine_spinners, engine_cpu),
    ):
        engine, frontends = _roles(server)
        _pin(engine, engine_cpu)
        for frontend in frontends:
            _pin(frontend, other_cpus)
        before, cpu_before = server.metrics(), _cpu(engine, frontends)
        with _affinity(other_cpus):  # the client processes inherit it
            figures = grpc_closed_loop(server, encode(short_texts, 1), opts)
        after, cpu_after = server.metrics(), _cpu(engine, frontends)
    calls = figures["calls"]
    engine_ms, frontend_ms = ((a - b) * 1000 / calls for a, b in zip(cpu_after, cpu_before, strict=True))
    figures.update(counter_figures(before, after, figures["span_s"]))
    figures.update(engine_cpu_ms_per_call=engine_ms, frontend_cpu_ms_per_call=frontend_ms)
    rows = figures["worker"]["rows_per_batch"]
    print(f"  engine-bound ({opts.engine_spinners} spinners beside the engine): {calls_text(figures)} calls/s, "
          f"engine {engine_ms * 1000:.0f} µs and front end {frontend_ms * 1000:.0f} µs a call, "
          f"{rows:.1f} rows a batch")  # fmt: skip
    return {"settings": settings, "engine_spinners": opts.engine_spinners, **figures}


@contextlib.contextmanager
def spinning(count: int, cpus: set[int]) -> Iterator[list[int]]:
    """``count`` busy processes on ``cpus``, for as long as the block runs; their pids."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        for spinner in spinners:
            os.sched_setaffinity(spinner.pid, cpus)
        yield [spinner.pid for spinner in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@contextlib.contextmanager
def _affinity(cpus: set[int]) -> Iterator[None]:
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _roles(server: Server) -> tuple[int, list[int]]:
    """The engine's pid and the front ends', by their command lines."""
    engine, frontends = 0, []
    for pid in process_tree(server.pid):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"kembed.engine" in command:
            engine = pid
        elif b"kembed.frontend" in command:
            frontends.append(pid)
    if not engine or not frontends:
        raise RuntimeError("engine-bound: the server's engine or front end is not running")
    return engine, frontends


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (threads started later inherit their creator's)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def _cpu(engine: int, frontends: list[int]) -> tuple[float, float]:
    return proc_cpu_seconds(engine), sum(proc_cpu_seconds(pid) for pid in frontends)
