"""Autoscaling a fleet of real servers by the HPA's own algorithm: ``python -m bench.fleet``.

One load (Poisson arrivals whose rate ramps from 0.5x one replica's measured capacity to 2.6x, spikes
to 3.5x and falls back; the same seed for every policy) against a fleet of real kembed servers on
loopback (``bench.fleet.pods``: the device modeled, everything else real), spread per call over the
ready pods as a ClusterIP Service balances them: per connection (``--balancing connection``, the
default: several client processes, gRPC with kembed's client defaults and REST with keep-alive as the
``openai`` SDK, each holding its connections to the pod it reached until the server's connection age
ends them: ``bench.fleet.service``), or per call at random (``--balancing call``). A real Prometheus scrapes every pod;
the metrics are read with the prometheus-adapter rules the chart ships, expanded as the adapter
expands them; ``bench.fleet.hpa`` scales the fleet with the targets and behavior the operator
renders for ``slo.p95LatencyMs``. The policies run one after the other on the same load: the
operator's HPA (the offered demand, drain time and P95 as guards), its previous rule (drain time
and P95), CPU utilisation at 70%, and the peers' (a
KEDA threshold of 5 waiting requests per pod, and a Knative-style concurrency target). Kubernetes'
periods are divided by ``COMPRESSION``; pod start (model load, warmup, readiness) is real.
Writes ``bench/results/fleet.json`` and ``fleet.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import RESULTS_DIR
from bench.fleet import hpa as fleet_hpa
from bench.fleet import judge as fleet_judge
from bench.fleet.device import COST_VAR, Cost, fit
from bench.fleet.judge import Sample, Segment
from bench.fleet.pods import Fleet, Replica
from bench.fleet.policies import (
    Policy,
    Rendered,
    adapter_queries,
    expand,
    pod_values,
    policies,
    prometheus,
    rendered,
    total_value,
)
from bench.fleet.record import per_second, rounded
from bench.fleet.traffic import Balancer, Connected, arrivals, offer, requests
from bench.tools.machine import read_result, write_result
from kembed.config.settings import Settings
from kembed_operator import render

COMPRESSION = 5.0  # Kubernetes' periods (sync, stabilisation, policies, probes) divided by this
SLO_MS = 1000  # slo.p95LatencyMs (the operator's default)

SLOWDOWN = 8.0  # the modeled device is this CPU's bf16 batch curve this many times slower

SAMPLE_S = 0.5

GRPC_CLIENTS = 8  # client processes on gRPC, each one channel
REST_CLIENTS = 8  # client processes on REST, each a keep-alive pool


@dataclass(frozen=True)
class Timing:
    """Kubernetes' periods, compressed."""

    sync_s: float
    probe_s: float
    prestop_s: float
    cpu_initialization_s: float

    @classmethod
    def compressed(cls, factor: float) -> Timing:
        return cls(
            fleet_hpa.SYNC_PERIOD_S / factor,
            5 / factor,  # the readiness probe's period the operator renders
            render.PRESTOP_SLEEP_S / factor,
            fleet_hpa.CPU_INITIALIZATION_PERIOD_S / factor,
        )


def cpu_utilisation(fleet: Fleet, request_cores: float) -> dict[str, float]:
    """Per pod, percent of its CPU request used since the last sample (metrics-server's window)."""
    fleet.sample_cpu()
    values = {}
    for replica in fleet.live:
        if len(replica.cpu_samples) >= 2:
            (t0, c0), (t1, c1) = replica.cpu_samples[-2:]
            values[replica.name] = 100 * (c1 - c0) / (t1 - t0) / request_cores
    return values


async def autoscale(
    fleet: Fleet,
    policy: Policy,
    controller: fleet_hpa.Controller,
    base: str,
    timing: Timing,
    request_cores: float,
    decisions: list[dict[str, Any]],
) -> None:
    """The HPA's sync loop: read the metrics, decide, scale the Deployment."""
    queries = adapter_queries()
    fleet.sample_cpu()
    while True:
        await asyncio.sleep(timing.sync_s - fleet.now() % timing.sync_s)
        now, current, pods = fleet.now(), fleet.scale, [r.as_pod() for r in fleet.live]
        proposals: list[int | None] = []
        seen: dict[str, dict[str, float]] = {}
        if policy.cpu_percent is not None:
            seen["cpu_percent"] = cpu_utilisation(fleet, request_cores)
            window = (now - timing.sync_s, now, timing.cpu_initialization_s)
            proposals.append(
                fleet_hpa.desired_for_metric(pods, seen["cpu_percent"], policy.cpu_percent, current, *window)
            )
        names = [p.name for p in pods]
        for metric, target in policy.metrics.items():
            promql = expand(queries[metric], metric, fleet.namespace, names)
            seen[metric] = await asyncio.to_thread(pod_values, base, promql)
            proposals.append(fleet_hpa.desired_for_metric(pods, seen[metric], target, current))
        for query, target in policy.external.items():
            total = await asyncio.to_thread(total_value, base, query.format(ns=fleet.namespace))
            seen[query] = {} if total is None else {"total": total}
            proposals.append(fleet_hpa.desired_for_total(total, target, current))
        decided = controller.decide(now, current, proposals)
        fleet.scale_to(decided)
        decisions.append({"t": now, "current": current, "proposals": proposals, "decided": decided, "values": seen})


async def probe_forever(fleet: Fleet, period: float) -> None:
    while True:
        await fleet.probe()
        await asyncio.sleep(period)


async def sample_forever(fleet: Fleet, samples: list[Sample]) -> None:
    while True:
        live = fleet.live
        samples.append(Sample(fleet.now(), fleet.scale, len(live), sum(1 for r in live if r.serving)))
        await asyncio.sleep(SAMPLE_S)


async def first_ready(fleet: Fleet, timing: Timing, start_limit_s: float = 600) -> Replica:
    replica = fleet.spawn()
    deadline = time.monotonic() + start_limit_s
    while not replica.ready:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{replica.name} not ready in {start_limit_s} s")
        await asyncio.sleep(timing.probe_s)
        await fleet.probe()
    return replica


@dataclass(frozen=True)
class Setup:
    rendered: Rendered
    cost: Cost
    timing: Timing
    segments: list[Segment]
    bodies: list[bytes]
    prometheus: str
    work: Path
    seed: int
    slo_ms: int
    balancing: str = "connection"  # or "call"
    clients: tuple[int, int] = (GRPC_CLIENTS, REST_CLIENTS)


def fleet_settings(setup: Setup) -> dict[str, str]:
    """The operator's settings, on the modeled device: one front end, compile off, the P95's and the
    demand's windows and the connection age compressed like the controller's periods."""
    window = float(setup.rendered.settings.get("latency_window_s", 10.0)) / COMPRESSION
    demand_s = float(setup.rendered.settings.get("demand_window_s", Settings().demand_window_s)) / COMPRESSION
    age_ms = int(Settings.model_fields["max_connection_age_ms"].default / COMPRESSION)
    return {
        **setup.rendered.settings,
        "frontends": "1",
        "compile": "off",
        "dtype": "float32",
        "latency_window_s": str(window),
        "demand_window_s": str(demand_s),
        "max_connection_age_ms": str(max(1000, age_ms)),
    }


def new_fleet(setup: Setup, namespace: str) -> Fleet:
    os.environ[COST_VAR] = setup.cost.env()  # the pods inherit it
    return Fleet(namespace, fleet_settings(setup), setup.work, setup.work / "targets.json", setup.timing.prestop_s)


async def calibrate(setup: Setup, seconds: float, concurrency: int = 24) -> dict[str, Any]:
    """One replica's capacity (answered calls per second, saturated by a closed loop that honours
    pushback), its CPU at that rate, and its start time."""
    fleet = new_fleet(setup, "calibration")
    replica = await first_ready(fleet, setup.timing)
    balancer = Balancer(fleet, setup.seed)
    answered = 0
    stop = fleet.now() + seconds

    async def client(k: int) -> None:
        nonlocal answered
        while fleet.now() < stop:
            outcome, _ = await balancer.call(setup.bodies[k % len(setup.bodies)])
            answered += outcome == "ok"
            k += concurrency
            if outcome != "ok":
                await asyncio.sleep(0.05)

    await asyncio.gather(*(client(k) for k in range(concurrency)))  # warms up the replica
    cpu0, t0, answered = replica.server.cpu_seconds(), fleet.now(), 0
    stop = t0 + seconds
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    elapsed = fleet.now() - t0
    cpu = (replica.server.cpu_seconds() - cpu0) / elapsed
    await balancer.close()
    await fleet.close()
    assert replica.ready_at is not None
    return {
        "capacity_per_s": answered / elapsed,
        "cpu_cores_at_capacity": cpu,
        "pod_start_s": replica.ready_at - replica.started_at,
        "seconds": elapsed,
    }


async def balancing(setup: Setup, fleet: Fleet) -> Balancer | Connected:
    if setup.balancing == "connection":
        return await Connected(fleet, setup.seed, *setup.clients).start()
    return Balancer(fleet, setup.seed)


async def run_policy(setup: Setup, policy: Policy, capacity: float, request_cores: float) -> dict[str, Any]:
    fleet = new_fleet(setup, policy.name)
    await first_ready(fleet, setup.timing)
    fleet.restart_clock()
    hpa = setup.rendered.hpa["spec"]
    behavior = fleet_hpa.behavior(policy.behavior).scaled(COMPRESSION)
    controller = fleet_hpa.Controller(behavior, hpa["minReplicas"], hpa["maxReplicas"])
    samples: list[Sample] = []
    decisions: list[dict[str, Any]] = []
    balancer = await balancing(setup, fleet)
    loops = [
        asyncio.create_task(probe_forever(fleet, setup.timing.probe_s)),
        asyncio.create_task(sample_forever(fleet, samples)),
        asyncio.create_task(
            autoscale(fleet, policy, controller, setup.prometheus, setup.timing, request_cores, decisions)
        ),
    ]
    load = arrivals(setup.segments, capacity, setup.seed)
    try:
        calls, attempts = await offer(balancer, fleet, load, setup.bodies, policy.retries)
    finally:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await balancer.close()
        await fleet.close()
    starts = [r.ready_at - r.started_at for r in fleet.replicas if r.ready_at is not None and r.started_at >= 0]
    pod_start = statistics.median(starts) if starts else math.nan
    slo_s = setup.slo_ms / 1000
    verdict = fleet_judge.judge(setup.segments, samples, calls, slo_s, setup.timing.sync_s, pod_start)
    verdict.update(fleet_judge.traffic_after_ready(_served(fleet, balancer.first_connection), setup.timing.sync_s))
    verdict["attempts_per_call"] = attempts / len(calls) if calls else math.nan
    return {
        "policy": asdict(policy),
        "pod_start_s": {"median": pod_start, "all": starts},
        "targets": verdict,
        "timeline": [asdict(s) for s in samples],
        "per_second": per_second(calls, setup.segments[-1].end, capacity, setup.segments),
        "decisions": decisions,
        "pods": [_pod_record(r) for r in fleet.replicas],
        "losses": dict(balancer.losses),
    }


def _served(fleet: Fleet, first_connection: Mapping[str, float]) -> list[tuple[float, float | None, float]]:
    """Every pod that turned ready during the run: (ready at, first connection at, serving until)."""
    end = fleet.now()
    return [
        (r.ready_at, first_connection.get(r.name), r.deleting_at if r.deleting_at is not None else end)
        for r in fleet.replicas
        if r.ready_at is not None and r.ready_at > 0
    ]


def _pod_record(replica: Replica) -> dict[str, Any]:
    keys = ("started_at", "ready_at", "deleting_at", "exited_at")
    return {"name": replica.name, **{k: getattr(replica, k) for k in keys}}


def device_cost() -> tuple[Cost, dict[str, Any]]:
    """The bf16 batch curve this CPU measured (bench.compute.ceiling), fitted, then slowed ``SLOWDOWN`` x."""
    ceiling = read_result("ceiling")
    if ceiling is None:
        raise SystemExit("bench.fleet needs bench/results/ceiling.json (python -m bench.compute.ceiling)")
    points = ceiling["batch_curve"]["bfloat16"]["points"]
    measured = fit(points)
    cost = measured.slowed(SLOWDOWN)
    source = {"from": "bench/results/ceiling.json batch_curve.bfloat16", "machine": ceiling["machine"]["cpu"]}
    return cost, {**source, "fitted": asdict(measured), "slowdown": SLOWDOWN, "modeled": asdict(cost)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cost, cost_note = device_cost()
    made = rendered(args.slo_ms)
    segments = fleet_judge.profile(args.scale)
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        work = Path(tmp)
        (work / "targets.json").write_text("[]")
        with prometheus(work, work / "targets.json") as base:
            timing = Timing.compressed(COMPRESSION)
            clients = (args.grpc_clients, args.rest_clients)
            setup = Setup(
                made, cost, timing, segments, requests(), base, work, args.seed, args.slo_ms, args.balancing, clients
            )
            calibration = await calibrate(setup, args.calibrate_s)
            print(f"bench.fleet: one replica {json.dumps(calibration)}", flush=True)
            capacity = calibration["capacity_per_s"]
            request_cores = calibration["cpu_cores_at_capacity"]
            chosen = [p for p in policies(args.slo_ms, capacity) if p.name in args.policies]
            runs = {}
            for policy in chosen:
                print(f"bench.fleet: {policy.name} ...", flush=True)
                runs[policy.name] = await run_policy(setup, policy, capacity, request_cores)
                print(json.dumps(_headline(runs[policy.name]["targets"])), flush=True)
            if args.keep_logs:
                shutil.copytree(work, args.keep_logs, dirs_exist_ok=True, ignore=shutil.ignore_patterns("tsdb"))
    return {
        "settings": {**vars(args), "compression": COMPRESSION, "timing": asdict(timing)},
        "operator": {"hpa": made.hpa["spec"], "server_settings": made.settings, "targets": made.targets},
        "device_cost": cost_note,
        "calibration": calibration,
        "cpu_request_cores": request_cores,
        "profile": [asdict(s) for s in segments],
        "policies": runs,
    }


def _headline(targets: Mapping[str, Any]) -> dict[str, Any]:
    keys = (
        "steps_reached_in_time",
        "steps_held_within_one",
        "no_flapping",
        "p95_met",
        "refusals_only_in_windows",
        "nothing_lost",
        "replica_seconds_ratio",
        "traffic_within_one_sync",
        "slo_seconds_per_replica_second",
        "refused",
        "lost",
        "p95_outside_windows_ms",
        "largest_over_needed",
        "attempts_per_call",
    )
    return {k: targets[k] for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="the profile's durations times this")
    parser.add_argument("--policies", nargs="+", default=[p.name for p in policies(SLO_MS)])
    parser.add_argument("--slo-ms", type=int, default=SLO_MS)
    parser.add_argument("--calibrate-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument("--balancing", choices=("connection", "call"), default="connection", help="as a ClusterIP")
    parser.add_argument("--grpc-clients", type=int, default=GRPC_CLIENTS, help="client processes on gRPC")
    parser.add_argument("--rest-clients", type=int, default=REST_CLIENTS, help="client processes on REST")
    parser.add_argument("--name", default="fleet", help="results file name (bench/results/<name>.json)")
    parser.add_argument("--keep-logs", default="", help="copy the pods' and Prometheus's logs here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    result = asyncio.run(run(args))
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    write_result(args.name, rounded(result))
    from bench.fleet.plot import plot

    plot(result, RESULTS_DIR / f"{args.name}.png")


if __name__ == "__main__":
    main()
