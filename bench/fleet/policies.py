"""The autoscaling policies compared, as the operator and its peers render them (HPA targets and
behavior, KEDA, Knative), and the Prometheus they read: the adapter's rules' queries, expanded."""

from __future__ import annotations

import contextlib
import json
import math
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.utils.quantity import parse_quantity

from bench.tools import prometheus as bench_prometheus
from kembed.contract import METRICS_PATH, Metric
from kembed_operator import kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.slo import derive
from kembed_operator.spec import parse_spec

MAX_REPLICAS = 6

CPU_TARGET_PERCENT = 70.0
FAST_DOWN = {"scaleDown": {"stabilizationWindowSeconds": 60}}
# The operator's rule before kembed_demand_ratio: drain time at P / 4 and the P95 at 0.8 P, the HPA's
# default behavior (what bench/results/fleet.json measured).
PREVIOUS_DRAIN, PREVIOUS_P95 = 0.25, 0.8

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
