"""Which HTTP stack for kembed's REST edge, measured beside the bare gRPC echo: ``python -m bench.edges.http_stacks``.

Each candidate of ``bench.edges.http_edges`` runs in a server process of its own (its HTTP server and an
idle ``grpc.aio`` server on one loop, as a front end would host them), and so does the gRPC echo,
the yardstick. Per ``--repeats`` round, every server in turn is started (time to ready, memory),
checked (one real reply of each encoding), then loaded closed loop with one short text a call by
h2load (nghttp2's C client: HTTP/1.1 keep-alive for the stacks, h2c for gRPC, so one neutral
client drives both), ``--connections`` connections with one call in flight each: a warm-up run,
then ``--duration`` s measured. Per load: calls/s, latency percentiles (h2load's per-request
log), the server's CPU milliseconds per call (/proc, all its threads) and the client's CPU.

The front-end budget: kembed's own per-call work, ``W`` (zero-cost kembed's CPU per call minus
the echo's, from ``bench/results/hostpath.json``), comes on top of either protocol, so the REST
edge keeps ``(grpc + W) / (stack + W)`` of gRPC's calls/s on a CPU-bound front end; the target is
>= 0.8.

Then, once per stack, with short limits: does it answer an oversized body 413, close an idle
keep-alive connection, close a slowloris connection (headers trickled a byte at a time), and let
a request in flight finish on SIGTERM?

Writes ``bench/results/http_stacks.json`` and the table in ``bench/README.md``. Needs h2load
(Debian: ``apt-get install nghttp2-client``). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import math
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench import RESULTS_DIR, plot
from bench.edges import http_edges
from bench.tools import machine
from bench.tools.report import Spread, latency_summary
from bench.tools.server import HOST, free_port, process_tree
from kembed.contract import GRPC_SERVICE
from kembed.v1 import embedder_pb2

README = Path(__file__).resolve().parents[1] / "README.md"
MARKERS = ("<!-- bench:http_stacks:begin -->", "<!-- bench:http_stacks:end -->")
TEXT = "one short text"
GRPC_PATH = f"/{GRPC_SERVICE}/Embed"
FORMATS = ("float", "base64")
TARGET_SHARE = 0.8  # of gRPC's calls/s, per front end, once kembed's own work is added
PROBE_LIMITS = http_edges.Limits(max_body_bytes=1 << 20, idle_s=1.0, request_s=2.0, drain_s=5.0)
Ratio = Callable[[dict[str, Any], dict[str, Any]], float]  # of a stack's load to gRPC's, in one round
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


# --- one server ---------------------------------------------------------------------------------


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
def started(stack: str, limits: http_edges.Limits, log: Path) -> Iterator[tuple[Running, subprocess.Popen[bytes]]]:
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
    if server.stack == http_edges.GRPC:
        with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
            embed = channel.unary_unary(GRPC_PATH, embedder_pb2.EmbedRequest.SerializeToString,
                                        embedder_pb2.EmbedResponse.FromString)  # fmt: skip
            reply = embed(embedder_pb2.EmbedRequest(texts=[TEXT]), timeout=10)
        if reply.count != 1 or len(reply.embeddings) != http_edges.echo.DIMENSIONS * 4:
            raise RuntimeError(f"grpc echo: unexpected reply {reply.count} x {len(reply.embeddings)} bytes")
        return
    for fmt in FORMATS:
        doc = json.loads(_post(server.port, request_body(fmt)))
        vector = doc["data"][0]["embedding"]
        got = np.frombuffer(base64.b64decode(vector), np.float32) if fmt == "base64" else np.array(vector, np.float32)
        if not np.array_equal(got, http_edges.EMBEDDING):
            raise RuntimeError(f"{server.stack}: the {fmt} embedding came back wrong")


def _post(port: int, body: bytes) -> bytes:
    request = urllib.request.Request(f"http://{HOST}:{port}{http_edges.EMBEDDINGS_PATH}", data=body,
                                     headers={"content-type": http_edges.JSON})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as reply:
        return bytes(reply.read())


def request_body(fmt: str) -> bytes:
    doc: dict[str, Any] = {"input": TEXT, "model": http_edges.MODEL_ID}
    if fmt != "float":
        doc["encoding_format"] = fmt
    return json.dumps(doc).encode()


def grpc_frame() -> bytes:
    """The gRPC message as it goes on the wire: uncompressed flag, big-endian length, the proto."""
    message = embedder_pb2.EmbedRequest(texts=[TEXT]).SerializeToString()
    return b"\0" + struct.pack(">I", len(message)) + message


# --- the load -----------------------------------------------------------------------------------


def h2load_argv(server: Running, body_file: Path, connections: int, seconds: float, log_file: Path) -> list[str]:
    """Closed loop: ``connections`` connections, one call in flight on each, for ``seconds``."""
    exe = shutil.which("h2load")
    if exe is None:
        raise RuntimeError("no h2load on PATH (Debian: apt-get install nghttp2-client)")
    common = [exe, "-c", str(connections), "-m", "1", "-t", "1", "-D", f"{round(seconds * 1000)}ms",
              "-d", str(body_file), "--log-file", str(log_file)]  # fmt: skip
    if server.stack == http_edges.GRPC:
        headers = ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        return [*common, *headers, f"http://{HOST}:{server.port}{GRPC_PATH}"]
    headers = ["-H", f"content-type: {http_edges.JSON}"]
    return [*common, "--h1", *headers, f"http://{HOST}:{server.port}{http_edges.EMBEDDINGS_PATH}"]


def parse_h2load(output: str) -> dict[str, Any]:
    """Calls/s, call counts and status classes from h2load's summary."""
    finished = re.search(r"finished in ([\d.]+)s, ([\d.]+) req/s", output)
    requests = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                         r"(\d+) errored, (\d+) timeout", output)  # fmt: skip
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", output)
    if not (finished and requests and codes):
        raise RuntimeError(f"unexpected h2load output:\n{output[-2000:]}")
    _, done, ok, failed, errored, timeout = (int(g) for g in requests.groups())
    classes = dict(zip(("2xx", "3xx", "4xx", "5xx"), (int(g) for g in codes.groups()), strict=True))
    return {"seconds": float(finished[1]), "calls_per_s": float(finished[2]), "calls": done, "succeeded": ok,
            "failed": failed, "errored": errored, "timeout": timeout, "codes": classes}  # fmt: skip


def log_latencies(log_file: Path) -> list[float]:
    """Seconds per call from h2load's ``--log-file`` (start us, status, duration us per line)."""
    return [int(line.split("\t")[2]) / 1e6 for line in log_file.read_text().splitlines() if line.count("\t") == 2]


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # only h2load is reaped meanwhile
    return usage.ru_utime + usage.ru_stime


def load(server: Running, body: bytes, opts: Options, work: Path) -> dict[str, Any]:
    """A warm-up run, then the measured one, with the server's and the client's CPU over it."""
    body_file, log_file = work / "body", work / "calls.log"
    body_file.write_bytes(body)
    subprocess.run(h2load_argv(server, body_file, opts.connections, opts.warmup, log_file), check=True,
                   capture_output=True)  # fmt: skip
    server_cpu, client_cpu = server.cpu_seconds(), _client_cpu()
    run = subprocess.run(h2load_argv(server, body_file, opts.connections, opts.duration, log_file),
                         check=True, capture_output=True, text=True)  # fmt: skip
    server_cpu, client_cpu = server.cpu_seconds() - server_cpu, _client_cpu() - client_cpu
    figures = parse_h2load(run.stdout)
    calls = figures["calls"]
    seconds = figures["seconds"]
    return {**figures, "latency_ms": latency_summary(log_latencies(log_file)),
            "server_cpu_ms_per_call": server_cpu * 1000 / calls if calls else math.nan,
            "server_cores": server_cpu / seconds, "client_cores": client_cpu / seconds}  # fmt: skip


def loads_of(stack: str) -> dict[str, bytes]:
    return {"grpc": grpc_frame()} if stack == http_edges.GRPC else {fmt: request_body(fmt) for fmt in FORMATS}


def one_round(opts: Options, round_index: int) -> dict[str, Any]:
    """Every stack in turn: start, check, load each body, peak memory."""
    figures: dict[str, Any] = {}
    for stack in opts.stacks:
        log = RESULTS_DIR / "tmp" / f"http_{stack}.log"
        with tempfile.TemporaryDirectory() as tmp, started(stack, http_edges.Limits(), log) as (server, _):
            rss_ready = server.memory_mib("VmRSS")
            time.sleep(SETTLE_S)  # grpc's threads finish starting after the server says it serves
            idle_cpu = server.run_seconds()
            time.sleep(opts.idle)  # what the server burns with nothing to do (timers, polling)
            idle_cpu = (server.run_seconds() - idle_cpu) * 1000 / opts.idle
            check_reply(server)
            result: dict[str, Any] = {"start": server.ready, "rss_ready_mib": rss_ready, "idle_cpu_ms_per_s": idle_cpu}
            for kind, body in loads_of(stack).items():
                result[kind] = f = load(server, body, opts, Path(tmp))
                print(f"  round {round_index + 1}, {stack}, {kind}: {f['calls_per_s']:.0f} calls/s, "
                      f"{f['server_cpu_ms_per_call']:.3f} CPU ms/call, p99 {f['latency_ms']['p99']:.2f} ms, "
                      f"codes {f['codes']}", flush=True)  # fmt: skip
            result["peak_rss_mib"] = server.memory_mib("VmHWM")
        figures[stack] = result
    return figures


# --- robustness probes --------------------------------------------------------------------------


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(HOST, port)


async def _closed_after(reader: asyncio.StreamReader, limit: float) -> float | None:
    """Seconds until the server closes the connection (whatever it sends first), or None if it is still open."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(limit):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    return time.perf_counter() - t0


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: {HOST}\r\ncontent-type: {http_edges.JSON}\r\n"
            f"content-length: {length}\r\n\r\n").encode()  # fmt: skip


async def _status(reader: asyncio.StreamReader) -> int | None:
    line = await reader.readline()
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None


async def _status_after(port: int, parts: Iterable[bytes]) -> int | None:
    """Send ``parts`` whole, as most clients do before they read, then the answer's status
    (None: the connection was dropped unanswered)."""
    reader, writer = await _connect(port)
    with contextlib.suppress(ConnectionError):
        for part in parts:
            writer.write(part)
            await writer.drain()
    try:
        return await asyncio.wait_for(_status(reader), PROBE_WAIT_S)
    except (TimeoutError, ConnectionError, ValueError):
        return None
    finally:
        writer.close()


async def probe_oversized(port: int, limit: int) -> int | None:
    """Status for a body twice the limit."""
    chunk = b" " * 65536
    return await _status_after(
        port, [_head(http_edges.EMBEDDINGS_PATH, 2 * limit)] + [chunk] * (2 * limit // len(chunk))
    )


async def probe_large_head(port: int) -> int | None:
    """Status for a valid request with one header 1 MiB long (200: taken)."""
    body = request_body("base64")
    head = _head(http_edges.EMBEDDINGS_PATH, len(body))[:-2] + b"x-padding: " + b"a" * (1 << 20) + b"\r\n\r\n"
    return await _status_after(port, [head + body])


async def probe_idle(port: int) -> float | None:
    """After one answered call on a keep-alive connection, seconds until the server closes it."""
    reader, writer = await _connect(port)
    body = request_body("base64")
    writer.write(_head(http_edges.EMBEDDINGS_PATH, len(body)) + body)
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    closed = await _closed_after(reader, PROBE_WAIT_S)
    writer.close()
    return closed


async def probe_slowloris(port: int) -> float | None:
    """Headers trickled one byte every 0.2 s, never finished: seconds until the server closes, or None."""
    reader, writer = await _connect(port)
    trickle = _head(http_edges.EMBEDDINGS_PATH, 10)[:-2] + b"x-padding: " + b"a" * 1000

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in trickle:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)

    sender = asyncio.create_task(send())
    closed = await _closed_after(reader, PROBE_WAIT_S)
    sender.cancel()
    writer.close()
    return closed


async def probe_graceful(port: int, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """A call that takes 1 s, SIGTERM while it is in flight: is it answered, and does the server exit 0?"""
    reader, writer = await _connect(port)
    body = json.dumps({"input": TEXT, "model": "m", "delay_s": 1.0}).encode()
    writer.write(_head(http_edges.EMBEDDINGS_PATH, len(body)) + body)
    await writer.drain()
    await asyncio.sleep(0.3)  # the request is in the handler's sleep by now
    proc.send_signal(signal.SIGTERM)
    try:
        status = await asyncio.wait_for(_status(reader), PROBE_WAIT_S)
    except (TimeoutError, ConnectionError, ValueError):
        status = None
    writer.close()
    exit_code = await asyncio.to_thread(proc.wait, PROBE_WAIT_S)
    return {"in_flight_status": status, "exit_code": exit_code}


def probes(stack: str) -> dict[str, Any]:
    with started(stack, PROBE_LIMITS, RESULTS_DIR / "tmp" / f"http_probe_{stack}.log") as (server, proc):
        figures: dict[str, Any] = {
            "oversized_status": asyncio.run(probe_oversized(server.port, PROBE_LIMITS.max_body_bytes)),
            "large_head_status": asyncio.run(probe_large_head(server.port)),
            "idle_closed_after_s": asyncio.run(probe_idle(server.port)),
            "slowloris_closed_after_s": asyncio.run(probe_slowloris(server.port)),
        }
        figures["graceful"] = asyncio.run(probe_graceful(server.port, proc))
    return {"limits": asdict(PROBE_LIMITS), "wait_s": PROBE_WAIT_S, **figures}


# --- the report ---------------------------------------------------------------------------------


def kembed_work_ms() -> dict[str, Any] | None:
    """kembed's own CPU per call on top of a bare server (zero-cost kembed minus the echo, one
    front end), from the last ``bench.serving.hostpath`` run."""
    hostpath = machine.read_result("hostpath") or {}
    pairs = [p for p in hostpath.get("host_path", []) if p.get("processes") == 1]
    if not pairs:
        return None
    zero, bare = pairs[0]["zero_cost"]["server_cpu_ms_per_call"], pairs[0]["echo"]["server_cpu_ms_per_call"]
    return {"ms": zero - bare, "zero_cost_ms": zero, "echo_ms": bare, "measured": hostpath["machine"]["time_utc"]}


def _spread(rounds: Sequence[dict[str, Any]], *path: str) -> dict[str, float]:
    """Median and range over the rounds of the figure at ``path``."""

    def at(figures: Any) -> float:
        for key in path:
            figures = figures[key]
        return float(figures)

    return Spread.of([at(r) for r in rounds]).to_dict()


def _over_grpc(rounds: Sequence[dict[str, Any]], stack: str, kind: str, ratio: Ratio) -> dict[str, float]:
    """``ratio(stack's load, gRPC's load)`` within each round: median and range."""
    return Spread.of([ratio(r[stack][kind], r[http_edges.GRPC]["grpc"]) for r in rounds]).to_dict()


# summary key: where the figure lies in a round's server (SERVER_FIGURES) or load (LOAD_FIGURES)
SERVER_FIGURES = {
    "spawn_to_ready_s": ("start", "spawn_to_ready_s"),
    "stack_start_s": ("start", "stack_start_s"),
    "rss_ready_mib": ("rss_ready_mib",),
    "peak_rss_mib": ("peak_rss_mib",),
    "idle_cpu_ms_per_s": ("idle_cpu_ms_per_s",),
}
LOAD_FIGURES = {
    "calls_per_s": ("calls_per_s",),
    "cpu_ms_per_call": ("server_cpu_ms_per_call",),
    "p50_ms": ("latency_ms", "p50"),
    "p99_ms": ("latency_ms", "p99"),
    "server_cores": ("server_cores",),
    "client_cores": ("client_cores",),
}


def summarize(rounds: Sequence[dict[str, Any]], work_ms: float | None) -> dict[str, Any]:
    """Per stack and body: median and range over rounds; ratios to gRPC taken within each round."""
    summary: dict[str, Any] = {}
    for stack in rounds[0]:
        per: dict[str, Any] = {key: _spread(rounds, stack, *path) for key, path in SERVER_FIGURES.items()}
        for kind in loads_of(stack):
            row = {key: _spread(rounds, stack, kind, *path) for key, path in LOAD_FIGURES.items()}
            if stack != http_edges.GRPC:
                row["calls_over_grpc"] = _over_grpc(rounds, stack, kind, calls_share)
                row["cpu_over_grpc"] = _over_grpc(rounds, stack, kind, cpu_share)
                if work_ms is not None:
                    with_kembed = functools.partial(with_kembed_share, work_ms=work_ms)
                    row["with_kembed_over_grpc"] = _over_grpc(rounds, stack, kind, with_kembed)
            per[kind] = row
        summary[stack] = per
    return summary


def calls_share(stack_load: dict[str, Any], grpc_load: dict[str, Any]) -> float:
    return float(stack_load["calls_per_s"] / grpc_load["calls_per_s"])


def cpu_share(stack_load: dict[str, Any], grpc_load: dict[str, Any]) -> float:
    return float(stack_load["server_cpu_ms_per_call"] / grpc_load["server_cpu_ms_per_call"])


def with_kembed_share(stack_load: dict[str, Any], grpc_load: dict[str, Any], work_ms: float) -> float:
    """The REST edge's calls/s over gRPC's on a CPU-bound front end, once kembed's own ``work_ms``
    a call comes on top of each protocol's own cost."""
    return float((grpc_load["server_cpu_ms_per_call"] + work_ms) / (stack_load["server_cpu_ms_per_call"] + work_ms))


def _fmt(spread: dict[str, float], digits: int = 0) -> str:
    return f"{spread['median']:.{digits}f} ({spread['lo']:.{digits}f}–{spread['hi']:.{digits}f})"


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def table(result: dict[str, Any]) -> str:
    """The README block: the figures per stack and body, then the probes."""
    m, summary = result["machine"], result["summary"]
    work = result["kembed_work"]
    lines = [
        f"Measured on {m['cpu']} ({m['cores']} cores), Python {m['python']}, git {m['git']}, at {m['time_utc']} "
        f"(load {m['loadavg_1_5_15'][0]}); {result['settings']['repeats']} rounds, median (range); h2load, "
        f"{result['settings']['connections']} keep-alive connections, 1 call in flight each, "
        f"{result['settings']['duration']:.0f} s per load. Ratios pair each round with its own gRPC echo. "
        + (f"kembed's own work W = {work['ms']:.3f} CPU ms/call (bench.serving.hostpath, {work['measured']})."
           if work else "No bench.serving.hostpath result: no projection with kembed's own work."),
        "",
        "| Server | Body | calls/s | / gRPC | CPU ms/call | / gRPC | (gRPC + W) / (stack + W) | p50 / p99 ms "
        "| Cores: server / client | Ready in s (stack start) | RSS MiB ready / peak | Idle CPU ms/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for stack, per in summary.items():
        start = f"{per['spawn_to_ready_s']['median']:.2f} ({per['stack_start_s']['median']:.3f})"
        memory = f"{per['rss_ready_mib']['median']:.0f} / {per['peak_rss_mib']['median']:.0f}"
        for kind in loads_of(stack):
            row = per[kind]
            ratio = _fmt(row["calls_over_grpc"], 2) if "calls_over_grpc" in row else "1"
            cpu_ratio = _fmt(row["cpu_over_grpc"], 2) if "cpu_over_grpc" in row else "1"
            projected = _fmt(row["with_kembed_over_grpc"], 2) if "with_kembed_over_grpc" in row else "—"
            latency = f"{row['p50_ms']['median']:.2f} / {row['p99_ms']['median']:.2f}"
            cores = f"{row['server_cores']['median']:.2f} / {row['client_cores']['median']:.2f}"
            lines.append(f"| {stack} | {kind} | {_fmt(row['calls_per_s'])} | {ratio} | "
                         f"{_fmt(row['cpu_ms_per_call'], 3)} | {cpu_ratio} | {projected} | {latency} | {cores} | "
                         f"{start} | {memory} | {per['idle_cpu_ms_per_s']['median']:.1f} |")  # fmt: skip
    if result.get("probes"):
        limits = next(iter(result["probes"].values()))["limits"]
        lines += [
            "",
            f"Probes (limits: body {limits['max_body_bytes']} B, idle {limits['idle_s']} s, request "
            f"{limits['request_s']} s, drain {limits['drain_s']} s; 'never' = still open after "
            f"{PROBE_WAIT_S:.0f} s):",
            "",
            "| Stack | Body 2x limit | 1 MiB header | Idle keep-alive closed | Slowloris closed "
            "| SIGTERM, call in flight: status / exit |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for stack, p in result["probes"].items():
            graceful = p["graceful"]
            lines.append(f"| {stack} | {p['oversized_status'] or 'dropped'} | {p['large_head_status'] or 'dropped'} | "
                         f"{_seconds(p['idle_closed_after_s'])} | "
                         f"{_seconds(p['slowloris_closed_after_s'])} | "
                         f"{graceful['in_flight_status'] or 'dropped'} / {graceful['exit_code']} |")  # fmt: skip
    return "\n".join(lines)


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
        result["probes"] = {s: probes(s) for s in opts.stacks if s != http_edges.GRPC}
    path = machine.write_result(opts.name, result)
    result = json.loads(path.read_text())  # with the machine's description
    block = table(result)
    README.write_text(plot.splice(README.read_text(), block, MARKERS))
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    everything = ",".join([http_edges.GRPC, *http_edges.STACKS])
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
    if unknown := set(stacks) - {http_edges.GRPC, *http_edges.STACKS}:
        parser.error(f"unknown stacks: {', '.join(sorted(unknown))}")
    ordered = (http_edges.GRPC, *(s for s in http_edges.STACKS if s in stacks))  # the yardstick first
    return run(Options(**{**vars(args), "stacks": ordered}))


if __name__ == "__main__":
    main()
