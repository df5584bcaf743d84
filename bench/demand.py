"""Is the offered demand linear in load: ``python -m bench.demand``.

One server (the real model, default settings). Its saturation first: ``--concurrency`` closed-loop
callers of one workload text a call, honouring the pushback (answered calls/s). Then Poisson
arrivals, open loop, at each of ``--multiples`` times that rate, ``--phase-s`` seconds each, from
``--client-processes`` client processes ``--client-nice`` below the server; and last ``--retry-x``
times it on channels with gRPC's own retry policy (which marks each retry with
``grpc-previous-rpc-attempts`` and honours the pushback), whose retries the gauge must count once.
``kembed_demand_ratio`` and the service rate it divides by are read from ``/metrics`` every second;
a phase's reading is their mean over its last ``--read-s`` seconds, three time constants of the
gauge after its start. Judged against issue 44's targets: 0.75 to 1.3 at 1x, within 25% of
proportional to 1x's reading at the other multiples, and 2.25 to 3.9 times 1x's reading at 3x with
retries. Writes ``bench/results/demand.json``.

    python -m bench.demand            # about 6 minutes
    python -m bench.demand --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench import RESULTS_DIR, loadgen, machine, workload
from bench.hostpath import encode
from bench.loadgen import OK, CallRecord
from bench.report import metric_sum
from bench.server import Server, running
from kembed.contract import GRPC_SERVICE, Metric

MAX_CALLS = 1_000_000  # the loads end on time; this only bounds a runaway
DEADLINE_S = 30.0
# gRPC's retry policy as a client's service config sets it: refused calls retried, the server's
# pushback honoured (grpc-retry-pushback-ms), each retry marked grpc-previous-rpc-attempts.
RETRY_POLICY = {
    "methodConfig": [
        {
            "name": [{"service": GRPC_SERVICE}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
            },
        }
    ]
}
RETRY_OPTIONS = (("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(RETRY_POLICY)))
AT_CAPACITY = (0.75, 1.3)  # the gauge at 1x
PROPORTIONAL = 0.25  # at the other multiples, within this share of multiple x the 1x reading
RETRIED = (2.25, 3.9)  # at 3x with retries, times the 1x reading


@dataclass(frozen=True)
class Options:
    concurrency: int
    saturation_s: float
    multiples: tuple[float, ...]
    retry_x: float
    phase_s: float
    read_s: float
    client_processes: int
    client_nice: int


class Gauge:
    """The demand and the service rate, read from the server's metrics every second in a thread."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self.readings: list[tuple[float, float, float]] = []  # (monotonic, demand, service rate)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> Gauge:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _read(self) -> None:
        while not self._stop.wait(1.0):
            samples = self._server.metrics()
            demand, rate = metric_sum(samples, Metric.DEMAND_RATIO), metric_sum(samples, Metric.SERVICE_RATE)
            self.readings.append((time.monotonic(), demand, rate))

    def over(self, start: float, end: float) -> dict[str, float]:
        demand = [d for t, d, _ in self.readings if start <= t < end]
        rate = [r for t, _, r in self.readings if start <= t < end]
        if not demand:
            return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "service_rate": float("nan")}
        return {"mean": statistics.fmean(demand), "min": min(demand), "max": max(demand),
                "service_rate": statistics.fmean(rate)}  # fmt: skip


def saturation(server: Server, requests: list[bytes], opts: Options) -> float:
    """Answered calls/s of the closed loop, its first fifth left out (warm-up)."""
    load = {"target": server.grpc_target, "requests": requests, "concurrency": opts.concurrency,
            "duration": opts.saturation_s, "count": MAX_CALLS, "deadline": DEADLINE_S}  # fmt: skip
    parts, _ = loadgen.in_processes(loadgen.closed_loop, [load], nice=opts.client_nice)
    start = opts.saturation_s / 5
    answered = [o for o in parts[0] if o.code == OK and o.done >= start]
    return len(answered) / (opts.saturation_s - start)


def phase(
    server: Server, gauge: Gauge, requests: list[bytes], rate: float, opts: Options, retries: bool = False
) -> dict[str, Any]:
    """One open-loop load at ``rate`` calls/s, split over the client processes; the gauge's reading
    over its last ``read_s`` seconds, and what became of the calls."""
    options = RETRY_OPTIONS if retries else ()
    loads = [
        {"target": server.grpc_target, "requests": requests, "rate": rate / opts.client_processes,
         "duration": opts.phase_s, "count": MAX_CALLS, "seed": workload.SEED + i, "deadline": DEADLINE_S,
         "options": options}
        for i in range(opts.client_processes)
    ]  # fmt: skip
    started = time.monotonic()
    parts, _ = loadgen.in_processes(loadgen.open_loop, loads, nice=opts.client_nice)
    end = started + opts.phase_s  # the clients' start-up is within it: the read ends with the arrivals
    outcomes = [o for part in parts for o in part]
    return {
        "offered_calls_per_s": rate,
        "retry_policy": retries,
        **_outcomes(outcomes, opts.phase_s),
        "demand": gauge.over(end - opts.read_s, end),
    }


def _outcomes(outcomes: Sequence[CallRecord], seconds: float) -> dict[str, Any]:
    codes: dict[str, int] = {}
    for outcome in outcomes:
        codes[outcome.code] = codes.get(outcome.code, 0) + 1
    return {"calls": len(outcomes), "answered_per_s": codes.get(OK, 0) / seconds, "codes": codes}


def judge(phases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Issue 44's targets for the gauge, each with its figure."""
    by_x = {(p["multiple"], p["retry_policy"]): p["demand"]["mean"] for p in phases}
    at_one = by_x[(1.0, False)]
    verdict: dict[str, Any] = {"at_1x": {"reading": at_one, "met": AT_CAPACITY[0] <= at_one <= AT_CAPACITY[1]}}
    for (multiple, retries), reading in by_x.items():
        ratio = reading / at_one
        if retries:
            verdict[f"retried_{multiple:g}x"] = {"over_1x": ratio, "met": RETRIED[0] <= ratio <= RETRIED[1]}
        elif multiple != 1.0:
            off = ratio / multiple - 1
            verdict[f"at_{multiple:g}x"] = {"over_1x": ratio, "off_proportional": off, "met": abs(off) <= PROPORTIONAL}
    return verdict


def run(opts: Options) -> dict[str, Any]:
    requests = encode(workload.load().texts, 1)
    phases = []
    with running({}, RESULTS_DIR / "demand_server.log") as server, Gauge(server) as gauge:
        calls_per_s = saturation(server, requests, opts)
        print(f"bench.demand: saturation {calls_per_s:.1f} calls/s", flush=True)
        plan = [(m, False) for m in opts.multiples] + ([(opts.retry_x, True)] if opts.retry_x else [])
        for multiple, retries in plan:
            figures = {"multiple": multiple, **phase(server, gauge, requests, multiple * calls_per_s, opts, retries)}
            print(f"bench.demand: {multiple:g}x{' retried' if retries else ''}: {json.dumps(figures)}", flush=True)
            phases.append(figures)
        served = server.served()
    return {
        "settings": asdict(opts),
        "served": served,
        "saturation_calls_per_s": calls_per_s,
        "phases": phases,
        "targets": judge(phases),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--saturation-s", type=float, default=40.0)
    parser.add_argument("--multiples", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--retry-x", type=float, default=3.0, help="offered with gRPC's retry policy (0: skip)")
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--read-s", type=float, default=15.0, help="the reading: the gauge's mean over a phase's last")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--client-nice", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="short phases: a check that it runs, not a figure")
    parser.add_argument("--name", default="demand")
    args = parser.parse_args()
    quick = {"saturation_s": 10.0, "phase_s": 12.0, "read_s": 4.0} if args.quick else {}
    opts = Options(args.concurrency, quick.get("saturation_s", args.saturation_s), tuple(args.multiples),
                   args.retry_x, quick.get("phase_s", args.phase_s), quick.get("read_s", args.read_s),
                   args.client_processes, args.client_nice)  # fmt: skip
    load_before = os.getloadavg()
    result = run(opts)
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    machine.write_result(args.name, result)
    print(json.dumps(result["targets"], indent=1))


if __name__ == "__main__":
    main()
