"""CPU inference below serving: the compute threads' niceness, in a fresh process (niceness cannot be
lowered again without privileges, so never in the test process itself), and in a real server; and
the CPU's bf16 units, read from its flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from kembed.engine import cpu, precision
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, server_fixture

PROBE = """
import json, os, threading
from kembed.engine import cpu

started, stop = threading.Event(), threading.Event()
def pool_thread():
    started.set()
    stop.wait()
threading.Thread(target=pool_thread, daemon=True).start()  # a pool thread that exists before the worker yields
started.wait()
result = {}
def worker():
    result["nice"] = cpu.yield_to_serving(7)
    child = threading.Thread(target=lambda: result.setdefault("child", os.getpriority(os.PRIO_PROCESS, 0)))
    child.start(); child.join()  # created after: inherits the worker's niceness
worker_thread = threading.Thread(target=worker)
worker_thread.start(); worker_thread.join()
def niceness(task):
    try:
        return os.getpriority(os.PRIO_PROCESS, task)
    except ProcessLookupError:  # a joined thread's task can outlive join() by a moment, then vanish
        return None
tasks = {int(t): niceness(int(t)) for t in os.listdir("/proc/self/task")}
tasks = {t: n for t, n in tasks.items() if n is not None}
result["main"] = tasks.pop(threading.main_thread().native_id)
result["others"] = sorted(set(tasks.values()))
stop.set()
print(json.dumps(result))
"""


@pytest.mark.process
def test_compute_threads_yield_to_the_main_thread() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout)
    expected = min(19, base + 7)
    assert result == {"nice": expected, "child": expected, "main": base, "others": [expected]}


@pytest.mark.process
def test_the_compile_thread_and_what_it_starts_run_only_on_idle_cpu() -> None:
    """The compile beside serving must not take the cores from admitted work: its thread, the
    threads it starts and the compiler processes it runs are SCHED_IDLE; the rest keep theirs."""
    seen: dict[str, object] = {}

    def compiling() -> None:
        seen["got"] = cpu.only_when_idle()
        seen["thread"] = os.sched_getscheduler(0)
        child = threading.Thread(target=lambda: seen.setdefault("its thread", os.sched_getscheduler(0)))
        child.start()
        child.join()
        code = "import os; print(os.sched_getscheduler(0))"
        seen["its process"] = int(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout)

    thread = threading.Thread(target=compiling)
    thread.start()
    thread.join()
    idle = os.SCHED_IDLE
    assert seen == {"got": "SCHED_IDLE", "thread": idle, "its thread": idle, "its process": idle}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread is untouched


def test_the_switch_interval_is_short_only_while_compiling() -> None:
    before = sys.getswitchinterval()
    with cpu.switching_often(cpu.COMPILE_SWITCH_INTERVAL_S):
        assert sys.getswitchinterval() == pytest.approx(cpu.COMPILE_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before


def thread_niceness(pid: int) -> dict[bool, set[int]]:
    """Niceness of a process's threads: {is the main thread: {values}}."""
    found: dict[bool, set[int]] = {True: set(), False: set()}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended while we listed them
            continue
        found[task.name == str(pid)].add(int(stat[16]))
    return found


server = server_fixture(frontends=1, compute_nice=6, dtype="auto")  # dtype: the default the harness pins


@pytest.mark.process
def test_on_cpu_the_compute_and_tokenizing_threads_run_below_serving(server: ServerProcess) -> None:
    """The engine's compute threads, and a front end's tokenizing threads (a large call is tokenized
    off the event loop, in one: at serving's priority a client's large bodies took the cores)."""
    base = os.getpriority(os.PRIO_PROCESS, server.process.pid)
    children = server.children()
    engine = thread_niceness(children["engine"])
    assert engine[True] == {base}  # the engine's event loop: admission, results
    assert engine[False] == {min(19, base + 6)}  # the worker and torch's pool
    with grpc.insecure_channel(server.target) as channel:  # a tokenizing thread starts for it
        pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["word " * 1000], truncate=True), timeout=300)
    frontend = thread_niceness(children["frontend-0"])
    assert frontend[True] == {base}  # the event loop: gRPC, REST, admission
    assert frontend[False] == {base, min(19, base + 6)}  # gRPC's and asyncio's threads; a tokenizing one
    assert "compute threads at niceness" in server.output()


@pytest.mark.process
def test_the_dtype_auto_serves_and_why_are_in_health_info_and_metrics(server: ServerProcess) -> None:
    health = server.health()
    dtype, why = health["dtype"], health["dtype_reason"]
    if precision.bf16_units():  # measured at warmup: bf16 unless it was not faster or not accurate
        assert why.startswith("auto: bf16 ") and (dtype == "bfloat16") == (re.search(", (under|not) ", why) is None)
    else:
        assert (dtype, why) == ("float32", "auto: no bf16 units (none of amx_bf16, avx512_bf16, bf16)")
    assert server.metric(f'kembed_serving_dtype{{dtype="{dtype}",reason="{why}"}}') == 1
    with grpc.insecure_channel(server.target) as channel:
        assert pb_grpc.EmbedderStub(channel).Info(pb.InfoRequest(), timeout=10).dtype == dtype


@pytest.mark.parametrize(
    ("cpuinfo", "units"),
    [
        ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", ("avx512_bf16",)),  # AMD EPYC (Zen 4)
        ("flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n", ("amx_bf16", "avx512_bf16")),  # Xeon
        ("flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n", ()),  # AVX-512 without bf16
        ("Features\t: fp asimd sve bf16 i8mm\n", ("bf16",)),  # Arm (Graviton 3)
        ("flags\t\t: fpu sse2 avx2\nbugs\t\t: bf16\n", ()),  # only the flags line counts
    ],
)
def test_bf16_units_are_read_from_the_cpus_flags(tmp_path: Path, cpuinfo: str, units: tuple[str, ...]) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: a CPU\n{cpuinfo}\n")
    assert precision.bf16_units(path) == units


def test_no_cpuinfo_means_no_bf16_units(tmp_path: Path) -> None:
    assert precision.bf16_units(tmp_path / "absent") == ()
