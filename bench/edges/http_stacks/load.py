"""The load: h2load against one server (warm-up, then measured), its calls/s, latency and the
server's and client's CPU; one round over every server and body format."""

from __future__ import annotations

import math
import re
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import RESULTS_DIR
from bench.edges.http_edges import api, process
from bench.edges.http_stacks.servers import (
    FORMATS,
    GRPC_PATH,
    SETTLE_S,
    Options,
    Running,
    check_reply,
    grpc_frame,
    request_body,
    started,
)
from bench.tools.report import latency_summary
from bench.tools.server import HOST


def h2load_argv(server: Running, body_file: Path, connections: int, seconds: float, log_file: Path) -> list[str]:
    """Closed loop: ``connections`` connections, one call in flight on each, for ``seconds``."""
    exe = shutil.which("h2load")
    if exe is None:
        raise RuntimeError("no h2load on PATH (Debian: apt-get install nghttp2-client)")
    common = [exe, "-c", str(connections), "-m", "1", "-t", "1", "-D", f"{round(seconds * 1000)}ms",
              "-d", str(body_file), "--log-file", str(log_file)]  # fmt: skip
    if server.stack == process.GRPC:
        headers = ["-H", "content-type: application/grpc", "-H", "te: trailers"]
        return [*common, *headers, f"http://{HOST}:{server.port}{GRPC_PATH}"]
    headers = ["-H", f"content-type: {api.JSON}"]
    return [*common, "--h1", *headers, f"http://{HOST}:{server.port}{api.EMBEDDINGS_PATH}"]


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
    return {"grpc": grpc_frame()} if stack == process.GRPC else {fmt: request_body(fmt) for fmt in FORMATS}


def one_round(opts: Options, round_index: int) -> dict[str, Any]:
    """Every stack in turn: start, check, load each body, peak memory."""
    figures: dict[str, Any] = {}
    for stack in opts.stacks:
        log = RESULTS_DIR / "tmp" / f"http_{stack}.log"
        with tempfile.TemporaryDirectory() as tmp, started(stack, api.Limits(), log) as (server, _):
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
