"""One candidate's server, started and stopped: the options, a server process of
``bench.edges.http_edges`` on a free port, its memory, and a check of its reply."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.edges.http_edges import api, process
from bench.tools import echo
from bench.tools.server import HOST, free_port, process_tree
from kembed.contract import GRPC_SERVICE
from kembed.v1 import embedder_pb2

TEXT = "one short text"
GRPC_PATH = f"/{GRPC_SERVICE}/Embed"
FORMATS = ("float", "base64")
TARGET_SHARE = 0.8  # of gRPC's calls/s, per front end, once kembed's own work is added
PROBE_LIMITS = api.Limits(max_body_bytes=1 << 20, idle_s=1.0, request_s=2.0, drain_s=5.0)

PROBE_WAIT_S = 8.0  # a probed connection still open this long is "never closed"
START_TIMEOUT_S = 60.0
SETTLE_S = 1.0


@dataclass(frozen=True)
class Options:
    stacks: tuple[str, ...]
    repeats: int
    connections: int
    duration: float
    warmup: float
    idle: float
    probes: bool
    name: str


@dataclass(frozen=True)
class Running:
    stack: str
    pid: int
    port: int
    ready: dict[str, Any]  # what the server said about its start

    def cpu_seconds(self) -> float:
        """User and system CPU time of every thread, those ended included, in clock ticks (10 ms)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(f) for f in fields[11:13]) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def run_seconds(self) -> float:
        """Time on a CPU of the live threads, to the nanosecond (schedstat): for small amounts."""
        return (
            sum(int(task.read_text().split()[0]) for task in Path(f"/proc/{self.pid}/task").glob("*/schedstat")) / 1e9
        )

    def memory_mib(self, field: str) -> float:
        """VmRSS (now) or VmHWM (peak) of the server process."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return math.nan


@contextlib.contextmanager
def started(stack: str, limits: api.Limits, log: Path) -> Iterator[tuple[Running, subprocess.Popen[bytes]]]:
    """``bench.edges.http_edges`` serving ``stack`` on a free port; SIGTERM (then SIGKILL) on the way out."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ready_file = Path(tmp) / "ready.json"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(limits).items()]
        argv = [sys.executable, "-m", "bench.edges.http_edges", "--stack", stack, "--port", str(port),
                "--ready-file", str(ready_file), *flags]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            try:
                while not ready_file.exists():
                    if proc.poll() is not None or time.perf_counter() - t0 > START_TIMEOUT_S:
                        raise RuntimeError(f"{stack} did not start (exit {proc.poll()}); see {log}")
                    time.sleep(0.01)  # start-up only
                ready = json.loads(ready_file.read_text()) | {"spawn_to_ready_s": time.perf_counter() - t0}
                yield Running(stack, proc.pid, port, ready), proc
            finally:
                _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            for pid in reversed(process_tree(proc.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()


def check_reply(server: Running) -> None:
    """One real call of each kind: the reply must carry the precomputed embedding, whole."""
    if server.stack == process.GRPC:
        with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
            embed = channel.unary_unary(GRPC_PATH, embedder_pb2.EmbedRequest.SerializeToString,
                                        embedder_pb2.EmbedResponse.FromString)  # fmt: skip
            reply = embed(embedder_pb2.EmbedRequest(texts=[TEXT]), timeout=10)
        if reply.count != 1 or len(reply.embeddings) != echo.DIMENSIONS * 4:
            raise RuntimeError(f"grpc echo: unexpected reply {reply.count} x {len(reply.embeddings)} bytes")
        return
    for fmt in FORMATS:
        doc = json.loads(_post(server.port, request_body(fmt)))
        vector = doc["data"][0]["embedding"]
        got = np.frombuffer(base64.b64decode(vector), np.float32) if fmt == "base64" else np.array(vector, np.float32)
        if not np.array_equal(got, api.EMBEDDING):
            raise RuntimeError(f"{server.stack}: the {fmt} embedding came back wrong")


def _post(port: int, body: bytes) -> bytes:
    request = urllib.request.Request(f"http://{HOST}:{port}{api.EMBEDDINGS_PATH}", data=body,
                                     headers={"content-type": api.JSON})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as reply:
        return bytes(reply.read())


def request_body(fmt: str) -> bytes:
    doc: dict[str, Any] = {"input": TEXT, "model": api.MODEL_ID}
    if fmt != "float":
        doc["encoding_format"] = fmt
    return json.dumps(doc).encode()


def grpc_frame() -> bytes:
    """The gRPC message as it goes on the wire: uncompressed flag, big-endian length, the proto."""
    message = embedder_pb2.EmbedRequest(texts=[TEXT]).SerializeToString()
    return b"\0" + struct.pack(">I", len(message)) + message
