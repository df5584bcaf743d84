"""The metrics chain: kembed server -> Prometheus -> the adapter's (and KEDA's) queries -> the HPA's numbers.

A real Prometheus scrapes a real kembed server on loopback, with the `namespace` and `pod` labels
that Kubernetes service discovery would attach. The prometheus-adapter rules shipped with the chart
are expanded the way the adapter expands them for an HPA's Pods metric, and must return, per pod,
the value the server exposes; the KEDA queries the operator renders must return the same. The
chart's dashboard queries return the server's series, and its alert expressions evaluate.
"""

from __future__ import annotations

import functools
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.tools import prometheus as bench_prometheus
from kembed.contract import METRICS_PATH, Metric
from kembed_operator import kinds, monitoring, render
from kembed_operator.config import OperatorConfig
from kembed_operator.spec import parse_spec
from tests.operator.conftest import CHART, wait_for
from tests.server.serving import serving

pytestmark = pytest.mark.timeout(300)
OWNER = render.Owner(name="emb", namespace="search", uid="u")
POD = "emb-7d4b9c8f6d-x2x9z"  # what a Deployment's pod is called
HPA_METRICS = (Metric.DEMAND_RATIO, Metric.QUEUE_DRAIN_SECONDS, Metric.LATENCY_P95_SECONDS)
# Checked before any fixture runs, so a machine without Prometheus does not start a server for nothing.
needs_prometheus = pytest.mark.skipif(
    not Path(bench_prometheus.BINARY).exists(),
    reason="prometheus is not installed (apt-get install prometheus; .ci/run does)",
)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        return getattr(err, "code", 0) or 0, ""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real kembed server; yields its HTTP base URL."""
    # latency_window_s: keeps the P95 still while the test compares it
    folder = tmp_path_factory.mktemp("kembed")
    with serving(folder, buckets="16,32", max_batch_size=8, latency_window_s=600) as process:
        _load(process.target)
        yield f"http://127.0.0.1:{process.http_port}"


def _load(target: str) -> None:
    from kembed.client import EmbedClient

    with EmbedClient(target) as client:
        for _ in range(8):
            client.embed(["a short text", "and a slightly longer one to fill a second bucket"])


@pytest.fixture(scope="module")
def prometheus(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("prometheus")
    target = urllib.parse.urlsplit(server).netloc
    scrape = {
        "job_name": "kembed",
        "metrics_path": METRICS_PATH,
        # The labels Kubernetes service discovery (or a PodMonitor) attaches to a pod's series.
        "static_configs": [{"targets": [target], "labels": {"namespace": OWNER.namespace, "pod": POD}}],
    }
    with bench_prometheus.running(work, [scrape]) as base:
        yield base


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    status, body = http_get(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    assert status == 200, body
    return list(json.loads(body)["data"]["result"])


def scraped(server: str, metric: str) -> float:
    """The value the server exposes right now."""
    _, text = http_get(server + METRICS_PATH)
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(metric + " "))


def adapter_rules() -> list[dict[str, Any]]:
    return list(yaml.safe_load((CHART / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"])


def expand(template: str, series: str) -> str:
    """The adapter's expansion for an HPA Pods metric over the pods of one namespace."""
    matchers = f'namespace="{OWNER.namespace}",pod=~"{POD}"'
    return (
        template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")
    )


def test_adapter_rules_cover_exactly_the_hpa_metrics() -> None:
    names = {rule["seriesQuery"].split("{")[0] for rule in adapter_rules()}
    hpa = next(
        c.manifest
        for c in render.render(OWNER, parse_spec({"maxReplicas": 2}), OperatorConfig())
        if c.kind == kinds.HPA
    )
    assert names == {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == set(HPA_METRICS)
    assert all(rule["resources"]["overrides"].keys() == {"namespace", "pod"} for rule in adapter_rules())


@needs_prometheus
@pytest.mark.process
@pytest.mark.parametrize("rule", adapter_rules(), ids=lambda rule: rule["seriesQuery"].split("{")[0])
def test_adapter_query_returns_what_the_server_exposes(rule: dict[str, Any], server: str, prometheus: str) -> None:
    metric = rule["seriesQuery"].split("{")[0]
    wait_for(f"{metric} series", lambda: query(prometheus, rule["seriesQuery"]), 60, 0.5)
    promql = expand(rule["metricsQuery"], metric)
    (sample,) = wait_for(promql, lambda: query(prometheus, promql), 60, 0.5)
    assert sample["metric"] == {"pod": POD}  # one value per pod, as the HPA's Pods metric wants
    assert_returns_what_the_server_exposes(server, prometheus, metric, promql)


@needs_prometheus
@pytest.mark.process
def test_keda_queries_return_what_the_server_exposes(server: str, prometheus: str) -> None:
    spec = parse_spec({"maxReplicas": 2, "autoscaling": {"provider": "keda"}})
    config = OperatorConfig(keda_server_address=prometheus)
    scaled = next(c.manifest for c in render.render(OWNER, spec, config) if c.kind == kinds.SCALED_OBJECT)
    for trigger in scaled["spec"]["triggers"]:
        promql = trigger["metadata"]["query"]
        metric = promql.removeprefix("sum(").split("{")[0]
        wait_for(promql, functools.partial(query, prometheus, promql), 60, 0.5)
        assert_returns_what_the_server_exposes(server, prometheus, metric, promql)


def assert_returns_what_the_server_exposes(server: str, prometheus: str, metric: str, promql: str) -> None:
    """The query's value is the server's: the same, for the gauges the fixture holds still; for the
    demand, which decays with no load (the fixture's calls were its only work), a value scraped
    between two reads of the server lies between them, and the fixture's load shows in it."""
    if metric != Metric.DEMAND_RATIO:
        (sample,) = query(prometheus, promql)
        assert float(sample["value"][1]) == pytest.approx(scraped(server, metric), abs=1e-3)
        return
    since, before = time.time(), scraped(server, metric)
    wait_for("a scrape after the first read", lambda: query(prometheus, f"timestamp({metric}) > {since}"), 60, 0.5)
    (sample,) = query(prometheus, promql)
    after = scraped(server, metric)
    assert 0 < after <= float(sample["value"][1]) <= before


def dashboard_query(expr: str) -> str:
    """A panel's query as Grafana sends it for the fixture's service (its pods' names less the suffixes)."""
    named = re.fullmatch(monitoring.POD_OF_A_SERVICE, POD)  # the service variable's regex
    assert named is not None
    service = named.group(1)
    filled = expr.replace("$namespace", OWNER.namespace).replace("$service", service)
    return filled.replace(monitoring.RATE, "1m")


@needs_prometheus
@pytest.mark.process
@pytest.mark.parametrize("panel", monitoring.PANELS, ids=lambda panel: panel.title)
def test_the_dashboards_queries_return_the_servers_series(
    panel: monitoring.Panel, server: str, prometheus: str
) -> None:
    """Every panel's query evaluates, and each returns a series of the fixture's server: all but the
    refusals, which its few calls never met."""
    for expr, _ in panel.queries:
        promql = dashboard_query(expr)
        if panel.title == "Refusals by reason":
            assert query(prometheus, promql) == []
        else:
            wait_for(promql, functools.partial(query, prometheus, promql), 60, 0.5)


@needs_prometheus
@pytest.mark.process
def test_every_alert_expression_evaluates(server: str, prometheus: str) -> None:
    """On the server's own series: none fires here (one idle pod, ready, no refusals, no drops)."""
    for group in monitoring.alert_groups()["groups"]:
        for rule in group["rules"]:
            assert query(prometheus, rule["expr"]) == [], rule["alert"]
