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
import collections
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import yaml
from kubernetes.utils.quantity import parse_quantity

from bench import RESULTS_DIR
from bench.fleet import hpa as fleet_hpa
from bench.fleet import judge as fleet_judge
from bench.fleet.device import COST_VAR, Cost, fit
from bench.fleet.judge import Call, Sample, Segment
from bench.fleet.pods import Fleet, Replica
from bench.fleet.service import ClusterIP, GrpcProcess, RestProcess
from bench.tools import prometheus as bench_prometheus
from bench.tools import workload
from bench.tools.loadgen import EMBED_METHOD, REJECTED
from bench.tools.machine import read_result, write_result
from bench.tools.report import percentile
from kembed.config import Settings
from kembed.contract import METRICS_PATH, RETRY_ATTEMPT_KEY, RETRY_PUSHBACK_KEY, Metric
from kembed.v1 import embedder_pb2
from kembed_operator import kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.slo import derive
from kembed_operator.spec import parse_spec

COMPRESSION = 5.0  # Kubernetes' periods (sync, stabilisation, policies, probes) divided by this
SLO_MS = 1000  # slo.p95LatencyMs (the operator's default)
MAX_REPLICAS = 6
SLOWDOWN = 8.0  # the modeled device is this CPU's bf16 batch curve this many times slower
CPU_TARGET_PERCENT = 70.0
FAST_DOWN = {"scaleDown": {"stabilizationWindowSeconds": 60}}
# The operator's rule before kembed_demand_ratio: drain time at P / 4 and the P95 at 0.8 P, the HPA's
# default behavior (what bench/results/fleet.json measured).
PREVIOUS_DRAIN, PREVIOUS_P95 = 0.25, 0.8
SAMPLE_S = 0.5
CALL_TIMEOUT_S = 30.0
GRPC_CLIENTS = 8  # client processes on gRPC, each one channel
REST_CLIENTS = 8  # client processes on REST, each a keep-alive pool
KEDA_WAITING = 5.0  # the vLLM production stack's KEDA threshold: waiting requests per pod
KNATIVE_SHARE = 0.7  # Knative's target utilisation of a pod's concurrency
STORM_RETRIES = 2  # the retry storm: each call up to three attempts, as many as gRPC's retry policy makes
# The peers' queries, as a KEDA Prometheus trigger sums them over the namespace (``{ns}``).
WAITING_QUERY = 'sum(kembed_waiting_requests{{namespace="{ns}"}})'
IN_FLIGHT_QUERY = WAITING_QUERY + ' + sum(kembed_running_requests{{namespace="{ns}"}})'
ADAPTER_VALUES = Path(__file__).resolve().parents[2] / "charts/kembed-operator/prometheus-adapter-values.yaml"
OWNER = render.Owner(name="emb", namespace="search", uid="fleet")
# The Deployment's settings the bench replaces: loopback ports, the modeled device's process.
BENCH_SET = ("grpc_host", "http_host", "grpc_port", "http_port", "rest_port", "device", "dtype", "compile_cache_dir")


@dataclass(frozen=True)
class Policy:
    name: str
    metrics: Mapping[str, float]  # Pods metric -> per-pod target (AverageValue)
    behavior: Mapping[str, Any] | None  # the rendered HPA's (None: the API's defaults)
    cpu_percent: float | None = None  # a CPU Resource metric's target utilisation instead
    external: Mapping[str, float] = field(default_factory=dict)  # a PromQL total (``{ns}``) -> per-pod target
    retries: int = 0  # a refused call is sent again after its pushback, this many times at most


@dataclass(frozen=True)
class Rendered:
    """What the operator renders for the SLO: the HPA and the server's settings."""

    hpa: dict[str, Any]
    settings: dict[str, str]  # names without the KEMBED_ prefix

    @property
    def targets(self) -> dict[str, float]:
        return {
            m["pods"]["metric"]["name"]: float(parse_quantity(m["pods"]["target"]["averageValue"]))
            for m in self.hpa["spec"]["metrics"]
        }

    @property
    def behavior(self) -> dict[str, Any] | None:
        return self.hpa["spec"].get("behavior")


def policies(slo_ms: int, capacity_per_s: float = 1.0) -> list[Policy]:
    """The operator's HPA as it renders it (the offered demand, drain time and P95 as guards, its own
    behavior); the operator's previous rule (drain time at P / 4, P95 at 0.8 P, the HPA's default
    behavior); CPU at 70% (what a user sets without kembed); and the peers': KEDA on 5 waiting
    requests per pod (the vLLM production stack's, the HPA's default behavior), and a Knative-style
    concurrency target (in-flight calls per pod at 0.7 of what a pod holds within the SLO,
    ``capacity_per_s`` x the SLO by Little's law, with Knative's 60 s window for scaling down). Last,
    the operator's HPA under a retry storm: every refused call sent again after its pushback, up to
    three attempts, each retry marked as kembed's client and the openai SDK mark it."""
    made, p = rendered(slo_ms), slo_ms / 1000
    previous = {Metric.QUEUE_DRAIN_SECONDS: PREVIOUS_DRAIN * p, Metric.LATENCY_P95_SECONDS: PREVIOUS_P95 * p}
    return [
        Policy("kembed", made.targets, made.behavior),
        Policy("drain_p95", previous, None),
        Policy("cpu70", {}, None, CPU_TARGET_PERCENT),
        Policy("keda_waiting5", {}, None, external={WAITING_QUERY: KEDA_WAITING}),
        Policy("knative70", {}, FAST_DOWN, external={IN_FLIGHT_QUERY: knative_target(capacity_per_s, slo_ms)}),
        Policy("kembed_storm3", made.targets, made.behavior, retries=STORM_RETRIES),
    ]


def knative_target(capacity_per_s: float, slo_ms: int) -> float:
    """In-flight calls per pod: 0.7 of the most a pod holds with each answered within the SLO."""
    return KNATIVE_SHARE * capacity_per_s * slo_ms / 1000


def rendered(slo_ms: int, autoscaling: dict[str, Any] | None = None) -> Rendered:
    """What the operator renders for ``slo_ms``, with ``autoscaling`` (the resource's field) if given."""
    extra = {} if autoscaling is None else {"autoscaling": autoscaling}
    spec = parse_spec({"minReplicas": 1, "maxReplicas": MAX_REPLICAS, "slo": {"p95LatencyMs": slo_ms}, **extra})
    hpa = next(c.manifest for c in render.render(OWNER, spec, OperatorConfig()) if c.kind == kinds.HPA)
    env = render.server_config(spec, derive(spec)).env
    settings = {k.removeprefix("KEMBED_").lower(): v for k, v in env.items()}
    return Rendered(hpa, {k: v for k, v in settings.items() if k not in BENCH_SET})


# --- Prometheus and the adapter's queries ---------------------------------------------------------


def prometheus(work: Path, targets_file: Path) -> contextlib.AbstractContextManager[str]:
    """A real Prometheus discovering pods from ``targets_file`` (as a PodMonitor would: every pod,
    ready or not), scraping each every second."""
    scrape = {
        "job_name": "kembed",
        "metrics_path": METRICS_PATH,
        "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
    }
    return bench_prometheus.running(work, [scrape])


def adapter_queries() -> dict[str, str]:
    """Metric name -> the adapter rule's metricsQuery template, from the chart's values."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return {rule["seriesQuery"].split("{")[0]: rule["metricsQuery"] for rule in rules}


def expand(template: str, metric: str, namespace: str, pods: Sequence[str]) -> str:
    """The adapter's expansion for an HPA Pods metric over ``pods`` of one namespace."""
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    filled = template.replace("<<.Series>>", metric).replace("<<.LabelMatchers>>", matchers)
    return filled.replace("<<.GroupBy>>", "pod")


def total_value(base: str, promql: str) -> float | None:
    """An instant query's one value (None without a sample)."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        result = json.loads(reply.read())["data"]["result"]
    values = [float(r["value"][1]) for r in result if math.isfinite(float(r["value"][1]))]
    return values[0] if values else None


def pod_values(base: str, promql: str) -> dict[str, float]:
    """Per-pod values of an instant query (pods without a sample are absent: missing)."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        result = json.loads(reply.read())["data"]["result"]
    return {r["metric"]["pod"]: float(r["value"][1]) for r in result if math.isfinite(float(r["value"][1]))}


# --- the load -------------------------------------------------------------------------------------


def arrivals(segments: Sequence[Segment], capacity: float, seed: int) -> list[float]:
    """A Poisson process whose rate follows the profile (thinning a homogeneous one)."""
    rng = random.Random(seed)
    peak = capacity * max(s.level_to for s in segments)
    end, t, times = segments[-1].end, 0.0, []
    while (t := t + rng.expovariate(peak)) < end:
        if rng.random() < capacity * fleet_judge.level_at(segments, t) / peak:
            times.append(t)
    return times


def requests(count: int = 512) -> list[bytes]:
    """One text per call from the bench workload (interactive, the default priority)."""
    texts = workload.load().texts[:count]
    return [embedder_pb2.EmbedRequest(texts=[t], truncate=True).SerializeToString() for t in texts]


class Balancer:
    """Per call, one ready pod at random (kube-proxy's choice among a Service's ready endpoints, made
    per call); ``first_connection``: when each pod got its first call."""

    def __init__(self, fleet: Fleet, seed: int) -> None:
        self._fleet = fleet
        self._rng = random.Random(seed)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.first_connection: dict[str, float] = {}
        self.losses: collections.Counter[str] = collections.Counter()  # calls lost, by why

    async def call(self, request: bytes, attempt: int = 0) -> tuple[str, float]:
        """The outcome and the pushback in seconds; ``attempt``: the attempts sent before this one."""
        endpoints = self._fleet.endpoints()
        if not endpoints:
            return "refused", 0.0  # a Service without endpoints refuses the connection
        replica = self._rng.choice(endpoints)
        self.first_connection.setdefault(replica.name, self._fleet.now())
        channel = self._channels.get(replica.name)
        if channel is None:
            channel = self._channels[replica.name] = grpc.aio.insecure_channel(replica.server.grpc_target)
        embed = channel.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=None)
        metadata = ((RETRY_ATTEMPT_KEY, str(attempt)),) if attempt else None
        try:
            await embed(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
            return "ok", 0.0
        except grpc.aio.AioRpcError as err:
            if (outcome := _outcome(err))[0] == "lost":
                self.losses[f"lost: gRPC {err.code().name} {err.details()}"] += 1
            return outcome

    async def close(self) -> None:
        await asyncio.gather(*(c.close(None) for c in self._channels.values()))


class Connected:
    """Per connection, as a ClusterIP Service balances: ``grpc_clients`` client processes on gRPC and
    ``rest_clients`` on REST, each call made by one of them at random, on the connections it holds."""

    def __init__(self, fleet: Fleet, seed: int, grpc_clients: int, rest_clients: int) -> None:
        self._fleet = fleet
        self._rng = random.Random(seed)
        endpoints: Callable[[], list[Replica]] = fleet.endpoints
        self._grpc = ClusterIP(endpoints, lambda r: r.server.grpc_target, random.Random(seed + 1))
        self._rest = ClusterIP(
            endpoints, lambda r: urllib.parse.urlsplit(r.server.rest_url).netloc, random.Random(seed + 2)
        )
        self._counts = (grpc_clients, rest_clients)
        self._clients: list[GrpcProcess | RestProcess] = []
        self.losses: collections.Counter[str] = collections.Counter()  # calls lost, by why

    async def start(self) -> Connected:
        grpc_target, rest_target = await self._grpc.start(self._fleet.now), await self._rest.start(self._fleet.now)
        self._clients = [GrpcProcess(grpc_target) for _ in range(self._counts[0])]
        self._clients += [RestProcess(f"http://{rest_target}") for _ in range(self._counts[1])]
        return self

    @property
    def first_connection(self) -> dict[str, float]:
        firsts: dict[str, float] = {}
        for name, at in [*self._grpc.first_connection.items(), *self._rest.first_connection.items()]:
            firsts[name] = min(at, firsts.get(name, at))
        return firsts

    async def call(self, request: bytes, attempt: int = 0) -> tuple[str, float]:
        """The outcome and the pushback in seconds; ``attempt``: the attempts sent before this one.
        (A retry goes from whichever client process: they share the one call's clock, not its pod.)"""
        answer = await self._rng.choice(self._clients).call(request, CALL_TIMEOUT_S, attempt)
        if isinstance(answer, grpc.aio.AioRpcError):
            outcome, pushback = _outcome(answer)
            if outcome == "lost":
                outcome = f"lost: gRPC {answer.code().name} {answer.details()}"
        else:
            outcome, pushback = answer
        if outcome.startswith("lost"):
            self.losses[outcome] += 1
            return "lost", 0.0
        return outcome, pushback

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients))
        await self._grpc.close()
        await self._rest.close()


def _outcome(err: grpc.aio.AioRpcError) -> tuple[str, float]:
    """A refusal is kembed's (a rejecting code with its pushback, returned in seconds); anything else
    lost an accepted call."""
    metadata = cast(grpc.aio.Metadata, err.trailing_metadata())
    pushback = None if metadata is None else metadata.get(RETRY_PUSHBACK_KEY)
    if err.code().name in REJECTED and pushback is not None:
        return "refused", int(pushback) / 1000
    return "lost", 0.0


async def offer(
    balancer: Balancer | Connected, fleet: Fleet, times: Sequence[float], bodies: Sequence[bytes], retries: int = 0
) -> tuple[list[Call], int]:
    """Every arrival sent at its time, whatever is outstanding, a refused one again after its
    pushback up to ``retries`` times; latency from the scheduled time. Also the attempts sent."""
    calls: list[Call] = []
    attempts = 0

    async def one(i: int, at: float) -> None:
        nonlocal attempts
        for attempt in range(retries + 1):
            attempts += 1
            outcome, pushback = await balancer.call(bodies[i % len(bodies)], attempt)
            if outcome != "refused" or attempt == retries:
                break
            await asyncio.sleep(pushback)
        calls.append(Call(at, fleet.now() - at, outcome))

    tasks = []
    for i, at in enumerate(times):
        await asyncio.sleep(at - fleet.now())
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.wait(tasks, timeout=CALL_TIMEOUT_S * (retries + 1) + 5)
    return sorted(calls, key=lambda c: c.scheduled), attempts


# --- the controller -------------------------------------------------------------------------------


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


# --- one policy's run ------------------------------------------------------------------------------


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
    """The operator's settings, on the modeled device: one front end, compile off, the P95's window
    and the connection age compressed like the controller's periods."""
    window = float(setup.rendered.settings.get("latency_window_s", 10.0)) / COMPRESSION
    age_ms = int(Settings.model_fields["max_connection_age_ms"].default / COMPRESSION)
    return {
        **setup.rendered.settings,
        "frontends": "1",
        "compile": "off",
        "dtype": "float32",
        "latency_window_s": str(window),
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


def per_second(calls: Sequence[Call], end: float, capacity: float, segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """One-second bins: offered rate (the profile's), calls by outcome, P95 of the answered."""
    bins: list[list[Call]] = [[] for _ in range(math.ceil(end))]
    for call in calls:
        if 0 <= call.scheduled < end:
            bins[int(call.scheduled)].append(call)
    return [
        {
            "t": i,
            "offered_per_s": capacity * fleet_judge.level_at(segments, i + 0.5),
            "calls": len(b),
            "refused": sum(c.outcome == "refused" for c in b),
            "lost": sum(c.outcome == "lost" for c in b),
            "p95_ms": 1000 * percentile([c.latency for c in b if c.outcome == "ok"], 95),
        }
        for i, b in enumerate(bins)
    ]


# --- the run ---------------------------------------------------------------------------------------


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
        "largest_over_ideal",
        "attempts_per_call",
    )
    return {k: targets[k] for k in keys}


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats to ``digits`` decimals, all through (a run's timeline is long; its clock is not that exact)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


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
