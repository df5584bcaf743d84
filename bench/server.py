"""A kembed server process for a benchmark: started on free loopback ports, always terminated."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.report import Samples, parse_prometheus
from kembed.contract import METRICS_PATH, READYZ_PATH, env_name

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Server:
    pid: int
    grpc_target: str
    http_url: str

    def metrics(self) -> Samples:
        with urllib.request.urlopen(self.http_url + METRICS_PATH, timeout=10) as reply:
            return parse_prometheus(reply.read().decode())

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the server process, all its threads."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def peak_rss_mib(self) -> float:
        """VmHWM: the most resident memory the server process has used since it started."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmHWM in /proc status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + READYZ_PATH, timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running(settings: Mapping[str, str], log: Path, start_timeout: float = 300.0) -> Iterator[Server]:
    """``python -m kembed`` with ``settings`` (names without the KEMBED_ prefix), ready to serve."""
    grpc_port, http_port = free_port(), free_port()
    overrides = {**settings, "grpc_host": HOST, "http_host": HOST, "grpc_port": grpc_port, "http_port": http_port}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEMBED_")}
    env.update({env_name(k): str(v) for k, v in overrides.items()})
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kembed"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            server = Server(proc.pid, f"{HOST}:{grpc_port}", f"http://{HOST}:{http_port}")
            deadline = time.monotonic() + start_timeout
            while not _ready(server.http_url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not become ready (exit {proc.poll()}); see {log}")
                time.sleep(0.5)  # start-up only: model load and warmup take seconds
            yield server
        finally:
            _stop(proc, grace=30)
