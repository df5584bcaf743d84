"""CPU inference below serving: the compute threads' niceness, in a fresh process (niceness cannot be
lowered again without privileges, so never in the test process itself), and in a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serving import ServerProcess

PROBE = """
import json, os, threading
from kembed.engine import cpu

started, stop = threading.Event(), threading.Event()
def pool_thread():
    started.set()
    stop.wait()
threading.Thread(target=pool_thread).start()  # a pool thread that exists before the worker yields
started.wait()
result = {}
def worker():
    result["nice"] = cpu.yield_to_serving(7)
    child = threading.Thread(target=lambda: result.setdefault("child", os.getpriority(os.PRIO_PROCESS, 0)))
    child.start(); child.join()  # created after: inherits the worker's niceness
worker_thread = threading.Thread(target=worker)
worker_thread.start(); worker_thread.join()
tasks = {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
result["main"] = tasks.pop(threading.main_thread().native_id)
result["others"] = sorted(set(tasks.values()))
stop.set()
print(json.dumps(result))
"""


def test_compute_threads_yield_to_the_main_thread() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout)
    expected = min(19, base + 7)
    assert result == {"nice": expected, "child": expected, "main": base, "others": [expected]}


def thread_niceness(pid: int) -> dict[bool, set[int]]:
    """Niceness of a process's threads: {is the main thread: {values}}."""
    found: dict[bool, set[int]] = {True: set(), False: set()}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found[task.name == str(pid)].add(int(stat[16]))
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    running = ServerProcess(tmp_path_factory.mktemp("cpu") / "server.log", frontends=1, compute_nice=6)
    yield running.wait_ready()
    running.stop()


@pytest.mark.slow
def test_on_cpu_only_the_engine_compute_threads_run_below_serving(server: ServerProcess) -> None:
    base = os.getpriority(os.PRIO_PROCESS, server.process.pid)
    children = server.children()
    engine = thread_niceness(children["engine"])
    assert engine[True] == {base}  # the engine's event loop: admission, results
    assert engine[False] == {min(19, base + 6)}  # the worker and torch's pool
    frontend = thread_niceness(children["frontend-0"])
    assert frontend[True] | frontend[False] == {base}
    assert "compute threads at niceness" in server.output()
