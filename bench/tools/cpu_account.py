"""Where a server's CPU goes: by process (supervisor, each front end, the engine), by thread, and by
stage of a call (parse, tokenize, screen and admission, link, engine loop, batch formation, forward,
pooling, answer, ...).

Two measurements over the same load, so the profiler never weighs on the figures it splits:

- ``CpuSnapshot``: each process's and each thread's user+system CPU seconds from ``/proc``, read
  before and after a window. Differences give each process's CPU exactly.
- ``sample_stages``: py-spy (``--nonblocking``: it never pauses the server) samples every Python
  thread of every process in a second window; each sample is one stage (``stage_of``: the innermost
  frame of a known kembed module, else the thread's own kind). A thread's CPU is shared out over its
  stages by its samples, since py-spy records a thread only while it runs. Threads py-spy cannot see
  (grpc's native pollers; torch's intra-op pool on hosts with more than one thread a lane) keep their
  thread's name as their stage.

``account`` puts the two together: each process's CPU seconds split by stage. The stages of a
process add up to its CPU by construction; what no sample explains is named (``unsampled``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.tools.server import process_tree

CLK_TCK = os.sysconf("SC_CLK_TCK")
PY_SPY_RATE = 250  # samples a second and thread: 1,000 a 4 s window for a busy thread

# The innermost frame of one of these files names the stage of a sample (first match, leaf first).
# Paths are matched as suffixes of the frame's file; a function name after ":" narrows a file.
STAGE_RULES: tuple[tuple[str, str], ...] = (
    ("kembed/metrics.py", "metrics"),
    ("prometheus_client/", "metrics"),
    ("logging/__init__.py", "logging"),
    ("kembed/domain/inputs.py", "tokenize"),
    ("kembed/domain/prompts.py", "tokenize"),
    ("kembed/frontend/grpc_messages.py:response", "answer"),
    ("kembed/frontend/grpc_api.py:_count", "answer"),
    ("kembed/frontend/grpc_api.py:_abort", "answer"),
    ("kembed/frontend/grpc_api.py:Embed", "answer"),
    ("kembed/frontend/openai_api.py:answer", "answer"),
    ("kembed/frontend/rest.py:_write", "answer"),
    ("kembed/frontend/rest.py:_reply", "answer"),
    ("kembed/frontend/quantize.py", "answer"),
    ("kembed/frontend/service.py:_result", "answer"),
    ("kembed/frontend/service.py:postprocess", "answer"),
    ("kembed/frontend/chunks.py", "answer"),
    ("kembed/frontend/grpc_api.py", "parse and check"),
    ("kembed/frontend/grpc_messages.py", "parse and check"),
    ("kembed/frontend/grpc_slots.py", "parse and check"),
    ("kembed/frontend/proto_scan.py", "parse and check"),
    ("kembed/frontend/openai_api.py", "parse and check"),
    ("kembed/frontend/json_body.py", "parse and check"),
    ("kembed/frontend/rest.py", "parse and check"),
    ("kembed/frontend/call.py", "parse and check"),
    ("kembed/frontend/connections.py", "parse and check"),
    ("kembed/frontend/screen.py", "screen and admission"),
    ("kembed/frontend/pushback.py", "screen and admission"),
    ("kembed/frontend/budget.py", "screen and admission"),
    ("kembed/policy/admission.py", "screen and admission"),
    ("kembed/policy/load.py", "screen and admission"),
    ("kembed/policy/demand.py", "screen and admission"),
    ("kembed/policy/shapes.py", "screen and admission"),
    ("kembed/frontend/link.py", "link and frames"),
    ("kembed/frontend/outbox.py", "link and frames"),
    ("kembed/frontend/inbox.py", "link and frames"),
    ("kembed/frontend/service.py", "service"),
    ("kembed/engine/pooling.py", "pooling"),
    ("kembed/engine/model.py", "forward"),
    ("kembed/engine/units.py:assemble", "batch assembly"),
    ("kembed/engine/runner.py", "batch assembly"),
    ("kembed/engine/worker.py", "worker hand-off"),
    ("kembed/engine/batcher.py", "batch formation"),
    ("kembed/engine/buckets.py", "batch formation"),
    ("kembed/engine/responder.py", "engine: responder"),
    ("kembed/engine/intake.py", "engine: intake"),
    ("kembed/engine/jobs.py", "engine: intake"),
    ("kembed/ipc/protocol.py", "frames (encode, decode)"),
    ("kembed/ipc/board.py", "board"),
    ("kembed/engine/process.py", "engine: loop"),
    ("kembed/supervisor/", "supervisor"),
)


def stage_of(frames: Sequence[tuple[str, str]], default: str) -> str:
    """The stage of one sample: ``frames`` as (file, function), root first."""
    for file, function in reversed(frames):
        for pattern, stage in STAGE_RULES:
            path, _, name = pattern.partition(":")
            in_file = file.endswith(path) or (path.endswith("/") and path in file)
            if in_file and (not name or function.split(".")[-1] == name):
                return stage
    return default


@dataclass(frozen=True)
class Proc:
    pid: int
    role: str  # supervisor, engine, frontend-N, or the command's module


def role_of(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    module = argv[argv.index("-m") + 1] if "-m" in argv else Path(argv[0]).name
    if module == "kembed.frontend" and "--index" in argv:
        return f"frontend-{argv[argv.index('--index') + 1]}"
    return {"kembed": "supervisor", "kembed.engine": "engine"}.get(module, module.rsplit(".", 1)[-1])


def server_processes(root: int) -> list[Proc]:
    return [Proc(pid, role_of(pid)) for pid in process_tree(root)]


def _stat_seconds(path: Path) -> float:
    """utime + stime of a /proc stat file (not its children's)."""
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class ProcCpu:
    total: float
    threads: dict[int, tuple[str, float]]  # tid -> (comm, seconds)


@dataclass
class CpuSnapshot:
    procs: dict[int, ProcCpu] = field(default_factory=dict)

    @classmethod
    def take(cls, procs: Iterable[Proc]) -> CpuSnapshot:
        snap = cls()
        for proc in procs:
            with contextlib.suppress(OSError):
                threads: dict[int, tuple[str, float]] = {}
                for task in Path(f"/proc/{proc.pid}/task").iterdir():
                    with contextlib.suppress(OSError, ValueError):
                        comm = (task / "comm").read_text().strip()
                        threads[int(task.name)] = (comm, _stat_seconds(task / "stat"))
                snap.procs[proc.pid] = ProcCpu(_stat_seconds(Path(f"/proc/{proc.pid}/stat")), threads)
        return snap


@dataclass(frozen=True)
class ThreadSamples:
    name: str  # Python's thread name
    stages: Counter[str]


def sample_stages(
    procs: Sequence[Proc], seconds: float, rate: int = PY_SPY_RATE
) -> dict[int, dict[int, ThreadSamples]]:
    """py-spy on every process at once for ``seconds``: each Python thread's samples by stage,
    by pid and native thread id. Empty where py-spy is missing or may not attach."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for proc in procs:
            out = Path(tmp) / f"{proc.pid}.json"
            argv = [py_spy, "record", "-p", str(proc.pid), "-d", str(max(1, round(seconds))), "-r", str(rate)]
            argv += ["-f", "speedscope", "--nonblocking", "--full-filenames", "-o", str(out)]
            runs[proc.pid] = (subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
        found = {}
        for proc in procs:
            popen, out = runs[proc.pid]
            popen.wait(seconds + 60)
            if out.is_file():
                found[proc.pid] = _read_speedscope(out, default=f"{proc.role}: runtime")
        return found


def _read_speedscope(path: Path, default: str) -> dict[int, ThreadSamples]:
    doc = json.loads(path.read_text())
    frames = [(f.get("file") or "", f.get("name") or "") for f in doc["shared"]["frames"]]
    threads: dict[int, ThreadSamples] = {}
    for profile in doc["profiles"]:
        # py-spy names each profile 'Thread <native id> "<python name>"'
        head, _, name = profile["name"].partition(" ")[2].partition(" ")
        stages: Counter[str] = Counter()
        for sample, weight in zip(profile["samples"], profile["weights"], strict=True):
            stages[stage_of([frames[i] for i in sample], default)] += weight
        threads[int(head)] = ThreadSamples(name.strip('"'), stages)
    return threads


@dataclass(frozen=True)
class Accounted:
    """A process's CPU seconds over a window, by stage and by thread (a thread's Python name where
    py-spy saw it, else its ``comm``)."""

    stages: dict[str, float]
    threads: dict[str, float]


def account(
    procs: Sequence[Proc], before: CpuSnapshot, after: CpuSnapshot, samples: Mapping[int, dict[int, ThreadSamples]]
) -> dict[str, Accounted]:
    """CPU seconds between the snapshots, by process role (``samples`` may come from another window
    of the same load: only their shares are used)."""
    out: dict[str, Accounted] = {}
    for proc in procs:
        if proc.pid not in before.procs or proc.pid not in after.procs:
            continue
        was, now = before.procs[proc.pid], after.procs[proc.pid]
        stages: dict[str, float] = defaultdict(float)
        threads: dict[str, float] = defaultdict(float)
        by_thread = samples.get(proc.pid, {})
        for tid, (comm, seconds) in now.threads.items():
            used = seconds - was.threads.get(tid, (comm, 0.0))[1]
            if used <= 0:
                continue
            sampled = by_thread.get(tid)
            threads[sampled.name if sampled else comm] += used
            if proc.role == "supervisor":
                stages["supervisor"] += used
            elif sampled is None:  # a native thread py-spy does not see
                stages[f"{proc.role}: thread {comm}"] += used
            elif not sampled.stages:
                stages[f"{proc.role}: unsampled ({sampled.name})"] += used
            else:
                total = sum(sampled.stages.values())
                for stage, weight in sampled.stages.items():
                    stages[stage] += used * weight / total
        ended = (now.total - was.total) - sum(stages.values())
        if abs(ended) > 1e-3:  # threads that ended within the window, or rounding of the ticks
            stages[f"{proc.role}: ended threads and rounding"] += ended
            threads["ended threads and rounding"] += ended
        out[proc.role] = Accounted(_by_size(stages), _by_size(threads))
    return out


def _by_size(seconds: Mapping[str, float]) -> dict[str, float]:
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
