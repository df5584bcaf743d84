"""The report: the rounds summarized per stack against gRPC's, projected with kembed's own work per
call (from the last ``bench.serving.hostpath`` run), and the README block."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from bench.edges.http_edges import process
from bench.edges.http_stacks.load import loads_of
from bench.edges.http_stacks.servers import PROBE_WAIT_S
from bench.tools import machine
from bench.tools.report import Spread

Ratio = Callable[[dict[str, Any], dict[str, Any]], float]  # of a stack's load to gRPC's, in one round


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
    return Spread.of([ratio(r[stack][kind], r[process.GRPC]["grpc"]) for r in rounds]).to_dict()


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
            if stack != process.GRPC:
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
