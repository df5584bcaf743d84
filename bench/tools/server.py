"""A server process for a benchmark: started on free loopback ports, always terminated.

``running`` starts ``python -m kembed`` (or a drop-in such as ``bench.tools.zero_cost``), ``echo_running``
the bare gRPC echo (``bench.tools.echo``). Both may be trees of processes (a supervisor, an engine, front
ends), so CPU and memory are summed over the tree, and a server that will not stop is killed whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from bench.tools.report import Samples, parse_prometheus
from kembed.contract import COMPILING, HEALTH_PATH, METRICS_PATH, READYZ_PATH, env_name
from kembed.plumbing import listen
from kembed.v1 import embedder_pb2, embedder_pb2_grpc

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Server:
    pid: int
    grpc_target: str
    http_url: str  # kembed's health and metrics port
    rest_url: str = ""  # http://host:port of the OpenAI API (``/v1/embeddings``), where it serves one

    def info(self) -> dict[str, Any]:
        """The server's own Info (model, device, dtype, plan), as ``MessageToDict`` writes it."""
        with grpc.insecure_channel(self.grpc_target) as channel:
            reply = embedder_pb2_grpc.EmbedderStub(channel).Info(embedder_pb2.InfoRequest(), timeout=30)
        return MessageToDict(reply)

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` document."""
        with urllib.request.urlopen(self.http_url + HEALTH_PATH, timeout=10) as reply:
            return dict(json.loads(reply.read()))

    def served(self) -> dict[str, Any]:
        """The dtype and the forward the server serves with, and why, off its ``/health``."""
        health = self.health()
        return {key: health.get(key) for key in ("dtype", "dtype_reason", "forward", "forward_reason")}

    def metrics(self) -> Samples:
        with urllib.request.urlopen(self.http_url + METRICS_PATH, timeout=10) as reply:
            return parse_prometheus(reply.read().decode())

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the server's process tree, all threads, reaped children included."""
        return sum(proc_cpu_seconds(pid) for pid in process_tree(self.pid))

    def peak_rss_mib(self) -> float:
        """Sum over the process tree of each process's VmHWM (its most resident memory since it
        started): an upper bound on the tree's peak, as the processes' peaks need not coincide."""
        return sum(_proc_peak_rss_mib(pid) for pid in process_tree(self.pid))


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants, parents first (from /proc/<pid>/task/<tid>/children)."""
    tree, i = [root], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the task or process ended meanwhile
                tree += [int(child) for child in task.read_text().split()]
        i += 1
    return tree


def proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (its threads and reaped children); 0 once it ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # ended since the tree was read
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime


def _proc_peak_rss_mib(pid: int) -> float:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM:")), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def is_settled(url: str) -> bool:
    """Ready, and its forward chosen for good (no compile beside serving under way)."""
    if not is_ready(url):
        return False
    with urllib.request.urlopen(url + HEALTH_PATH, timeout=10) as reply:
        return COMPILING not in str(json.loads(reply.read()).get("forward_reason"))


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + READYZ_PATH, timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; descendants left behind are killed too."""
    if proc.poll() is not None:
        return
    tree = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in tree[1:]:  # ours a moment ago: reuse of a pid within seconds is unlikely
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _started(
    argv: Sequence[str], env: Mapping[str, str], log: Path, ready: Callable[[], bool], start_timeout: float
) -> Iterator[int]:
    """The process's pid once ``ready()``; always stopped on the way out."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout
            while not ready():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[-1]} did not become ready (exit {proc.poll()}); see {log}")
                time.sleep(0.2)  # start-up only: model load and warmup take seconds
            yield proc.pid
        finally:
            _stop(proc, grace=30)


@contextlib.contextmanager
def running(
    settings: Mapping[str, str],
    log: Path,
    module: str = "kembed",
    start_timeout: float = 300.0,
    settled: bool = True,
) -> Iterator[Server]:
    """``python -m <module>`` (kembed or a drop-in for it) with ``settings`` (names without the
    KEMBED_ prefix), ready to serve; every port one the kernel picks (port 0), read off the server's
    first line (two benchmarks never share one, nor lose one found free to another process). With
    ``settled``, also past the compile a CPU runs beside serving once ready: a benchmark measures
    the forward that serves for good, not the minute the compile shares the cores."""
    found: list[Server] = []

    def up() -> bool:
        if not found:
            ports = listen.listening_ports(log.read_text(errors="replace"))
            if ports is None:
                return False
            found.append(_on_ports(ports["grpc"], ports["http"], ports["rest"]))
        return is_settled(found[0].http_url) if settled else is_ready(found[0].http_url)

    with _started(["-m", module], kembed_env({**settings, **listen.ANY_PORTS}), log, up, start_timeout) as pid:
        yield dataclasses.replace(found[0], pid=pid)


def server_env(settings: Mapping[str, str]) -> tuple[dict[str, str], Server]:
    """The environment of a server with ``settings`` (names without the KEMBED_ prefix) on ports
    found free (``running`` takes port 0 instead: a port found free may be taken before the server
    binds it), and its addresses (``pid`` 0 until started): for a fleet, whose pods' addresses are
    published as they are created."""
    grpc_port, http_port, rest_port = free_port(), free_port(), free_port()
    env = kembed_env({**settings, "grpc_port": grpc_port, "http_port": http_port, "rest_port": rest_port})
    return env, _on_ports(grpc_port, http_port, rest_port)


def kembed_env(settings: Mapping[str, Any]) -> dict[str, str]:
    """This environment less its ``KEMBED_*`` variables, plus ``settings`` on loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEMBED_")}
    env.update({env_name(k): str(v) for k, v in {**settings, "grpc_host": HOST, "http_host": HOST}.items()})
    return env


def _on_ports(grpc_port: int, http_port: int, rest_port: int) -> Server:
    return Server(0, f"{HOST}:{grpc_port}", f"http://{HOST}:{http_port}", f"http://{HOST}:{rest_port}")


@contextlib.contextmanager
def echo_running(processes: int, log: Path, start_timeout: float = 60.0) -> Iterator[Server]:
    """``python -m bench.tools.echo`` with ``processes`` processes on one port (the kernel's pick, which it
    writes to its ready file), all of them serving. It has no HTTP port: ``http_url`` is empty and
    ``metrics()`` does not apply."""
    with tempfile.TemporaryDirectory() as tmp:
        ready_file = Path(tmp) / "ready"
        argv = ["-m", "bench.tools.echo", "--processes", str(processes), "--port", "0", "--ready-file", str(ready_file)]
        with _started(argv, os.environ, log, ready_file.exists, start_timeout) as pid:
            yield Server(pid, f"{HOST}:{ready_file.read_text()}", "")
