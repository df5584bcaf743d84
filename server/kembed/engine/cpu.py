"""How CPU inference shares the cores with serving: compute yields, serving never waits for it.

When the model runs on the CPU, its threads (the worker and torch's intra-op pool) want every core,
and so do the front ends and the engine's event loop whenever a call arrives: to refuse it, admit
it or answer it. Whoever waits for the other loses something. Serving waiting for compute makes a
rejection take as long as a batch (seconds, not the microseconds it costs); compute waiting for
serving only loses the microseconds a call costs. So the compute threads run at a higher niceness
(``KEMBED_COMPUTE_NICE``) than every process and thread that talks to clients, and the kernel
preempts them the moment serving has work. Raising one's own niceness needs no capability, so it
works in a container without privileges; nothing here ever lowers it.

On a GPU the worker thread only launches work for the device: it is the device's feeder and keeps
the process's priority.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

TASKS = Path("/proc/self/task")
CGROUP_CPU_STAT = Path("/sys/fs/cgroup/cpu.stat")  # cgroup v2: the container's own use
PROC_STAT = Path("/proc/stat")
MAX_NICE = 19
T = TypeVar("T")


def yield_to_serving(compute_nice: int) -> int:
    """Put every thread of this process but the main one (the engine's event loop) ``compute_nice``
    below it: the worker thread (the caller) and torch's pool, if it exists yet (threads the worker
    creates later inherit its niceness). Returns the niceness they run at."""
    main = threading.main_thread().native_id or os.getpid()  # the main thread's id is the process's
    target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, main) + compute_nice)
    threads = [int(task.name) for task in TASKS.iterdir()] if TASKS.is_dir() else [threading.get_native_id()]
    for tid in threads:
        if tid == main:
            continue
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
    return target


def share_cores(cpus: float, compute_nice: int) -> None:
    """CPU inference: torch's intra-op threads for the CPUs this pod may use (``Settings.cpus``:
    its quota or request, not the node's cores, which would be throttled at every barrier), all
    below serving. Call on the worker thread: warmup runs each batch on all of them."""
    threads = max(1, int(cpus))
    torch.set_num_threads(threads)
    nice = yield_to_serving(compute_nice)
    log.info("CPU inference: %d compute threads at niceness %d, below serving", threads, nice)


# While the forward compiles beside serving, the compile thread (Python: dynamo tracing, inductor's
# code generation) holds the GIL whenever it runs, and a lane's forward takes the GIL back between
# every operator: at Python's default 5 ms switch interval a lane could wait that long per operator.
# A shorter interval bounds the wait; it is restored once the compile is done.
COMPILE_SWITCH_INTERVAL_S = 0.0005


def only_when_idle() -> str:
    """Run the calling thread, and the processes and threads it starts from now on (inductor's g++
    builds and compile workers), only on CPU time that no other thread wants: ``SCHED_IDLE``, which
    an unprivileged thread may take, else the highest niceness. Returns which it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError):  # not Linux, or a kernel without it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MAX_NICE)
        return f"niceness {MAX_NICE}"
    return "SCHED_IDLE"


def switching_often(interval_s: float) -> contextlib.AbstractContextManager[None]:
    """Python's thread switch interval at ``interval_s`` for a while (see ``COMPILE_SWITCH_INTERVAL_S``)."""
    return _for_a_while(sys.getswitchinterval, sys.setswitchinterval, interval_s)


def lane_threads(cpus: float, lanes: int) -> int:
    """Intra-op threads of each of ``lanes`` batches computed at once: the CPUs shared out."""
    return max(1, int(cpus) // max(1, lanes))


def enter_lane(threads: int) -> None:
    """Run this thread's batches on ``threads`` intra-op threads. OpenMP keeps the count per
    calling thread, so each lane sets its own and the lanes' batches never share a barrier."""
    torch.set_num_threads(threads)


def threads_of_a_lane(threads: int) -> contextlib.AbstractContextManager[None]:
    """This thread's batches on ``threads`` intra-op threads for a while: timing a batch as one lane
    computes it."""
    return _for_a_while(torch.get_num_threads, torch.set_num_threads, threads)


@contextlib.contextmanager
def _for_a_while(read: Callable[[], T], write: Callable[[T], None], value: T) -> Iterator[None]:
    """A setting at ``value`` for the block, then back to what it was."""
    before = read()
    write(value)
    try:
        yield
    finally:
        write(before)


def cpu_seconds_used(cgroup_stat: Path = CGROUP_CPU_STAT, proc_stat: Path = PROC_STAT) -> tuple[float, bool]:
    """CPU seconds spent so far by this container (cgroup v2's ``usage_usec``), and True; where it
    cannot be read, by the whole machine (``/proc/stat``, idle and iowait left out), and False."""
    try:
        for line in cgroup_stat.read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6, True
    except (OSError, ValueError):
        pass
    ticks = [int(field) for field in proc_stat.read_text().split("\n", 1)[0].split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK"), False
