"""The dashboard and alert rules the chart ships: generated from the metric names the server exports
(a query naming any other fails here), rendered by the chart (off by default) as a ConfigMap valid
for Kubernetes and a PrometheusRule of the Prometheus Operator's shape, and every alert expression
parsed by promtool, the main ones tested to fire (and not to) on series written for them. Their
queries against a real Prometheus scraping a real server: tests/operator/test_metrics_chain.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from kembed.contract import Metric
from kembed.ipc.board import Board
from kembed.metrics import BoardGauges, EngineMetrics, FrontendMetrics
from kembed_operator import monitoring
from tests.operator.conftest import ROOT, render_chart

K8S_VERSION = "1.34.0"
ENABLED = {"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}
METRIC_NAME = re.compile(r"\bkembed_[a-z0-9_]+")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
# The PrometheusRule's shape as the Prometheus Operator documents it (monitoring.coreos.com/v1), and no
# field beside: a CRD's schema is not among kubernetes-validate's, and its API server prunes unknown fields.
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": DURATION},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr", "labels", "annotations"],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": {"type": "string", "pattern": DURATION},
                                        "labels": STRINGS,
                                        "annotations": STRINGS,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def exported_series(tmp_path: Path) -> set[str]:
    """Every series name the server's /metrics can carry, from its own metric objects: a counter
    with ``_total``, a histogram's buckets, sum and count, and the board's gauges."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    objects = [
        value
        for source in (FrontendMetrics(), EngineMetrics())
        for value in vars(source).values()
        if isinstance(value, MetricWrapperBase)
    ]
    names = {f"{family.name}{suffix}" for m in objects for family in m.describe() for suffix in suffixes[family.type]}
    board = BoardGauges(Board(tmp_path / "board", frontends=1), lambda: True, 15.0)
    return names | {family.name for family in board.collect()}


def dashboard_queries() -> list[str]:
    board = monitoring.dashboard()
    panels = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    return panels + [variable["definition"] for variable in board["templating"]["list"] if "definition" in variable]


def alert_expressions() -> list[str]:
    return [rule["expr"] for group in monitoring.alert_groups()["groups"] for rule in group["rules"]]


def rendered(kind: str) -> dict[str, Any]:
    (manifest,) = [doc for doc in render_chart(ENABLED) if doc["kind"] == kind]
    return manifest


def test_the_chart_holds_what_the_generator_writes() -> None:
    for path, text in monitoring.files().items():
        assert (ROOT / path).read_text() == text, f"{path} is stale: run `make monitoring`"


def test_every_query_names_only_metrics_the_server_exports(tmp_path: Path) -> None:
    exported = exported_series(tmp_path)
    assert {"kembed_rejected_total", "kembed_batch_size_bucket", Metric.DEMAND_RATIO} <= exported  # the rule above
    for query in dashboard_queries() + alert_expressions():
        named = set(METRIC_NAME.findall(query))
        assert named and named <= exported, f"{query}: {named - exported} not exported by the server"


def test_the_dashboard_shows_what_an_operator_watches() -> None:
    queries = "\n".join(dashboard_queries())
    for metric in (
        Metric.DEMAND_RATIO,  # demand
        Metric.QUEUE_DRAIN_SECONDS,  # drain time
        Metric.LATENCY_P95_SECONDS,  # P95
        Metric.WAITING_REQUESTS,  # queue
        Metric.BATCH_SIZE,  # batch rows
    ):
        assert metric in queries
    assert f"sum by (reason) (rate({Metric.REJECTED}_total" in queries  # refusals by reason
    assert f'{Metric.TOKENS}_total{{namespace="$namespace", pod=~"$service-[a-z0-9]+-[a-z0-9]+", kind="padding"}}' in (
        queries
    )
    panels = monitoring.dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(cells) == len(panels) and all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)


def test_both_are_off_by_default() -> None:
    assert not {"ConfigMap", "PrometheusRule"} & {doc["kind"] for doc in render_chart()}


def test_the_dashboard_configmap_is_valid_and_labelled_for_grafanas_sidecar() -> None:
    config_map = rendered("ConfigMap")
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["kembed-dashboard.json"]) == monitoring.dashboard()
    elsewhere = {
        "grafanaDashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "ml"}}
    }
    (moved,) = [doc for doc in render_chart(elsewhere) if doc["kind"] == "ConfigMap"]
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "ml"}


def test_the_prometheus_rule_has_the_operators_shape_and_the_generated_groups() -> None:
    rule = rendered("PrometheusRule")
    jsonschema.Draft7Validator(PROMETHEUS_RULE).validate(rule)
    assert rule["spec"] == monitoring.alert_groups()
    assert rule["metadata"]["labels"]["release"] == "kps"  # what a Prometheus's ruleSelector matches


@pytest.mark.parametrize(
    "values",
    [
        {"grafanaDashboard": {"enabled": "yes"}},
        {"prometheusRule": {"labels": {"a": 1}}},
        {"grafanaDashboard": {"x": 1}},
    ],
    ids=["flag", "label-value", "unknown-key"],
)
def test_values_schema_rejects_bad_monitoring_values(values: dict[str, Any]) -> None:
    with pytest.raises(Exception, match=r"(?i)schema|validat"):
        render_chart(values)


@pytest.mark.process
@needs_promtool
def test_promtool_parses_every_rule_of_the_rendered_chart(tmp_path: Path) -> None:
    rules = tmp_path / "kembed-alerts.yaml"
    rules.write_text(yaml.safe_dump(rendered("PrometheusRule")["spec"]))
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_expressions())} rules found" in result.stdout


POD = {"namespace": "search", "pod": "bge-small-7d4b9c8f6d-x2x9z"}
OTHER_POD = {"namespace": "search", "pod": "bge-small-7d4b9c8f6d-k8m2p"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    matchers = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{matchers}}}", "values": values}


def expected(alert: str, labels: dict[str, str], **values: str) -> dict[str, Any]:
    """The alert as Prometheus would send it: its rule's labels and annotations, templates filled in."""
    rule = next(r for g in monitoring.alert_groups()["groups"] for r in g["rules"] if r["alert"] == alert)
    annotations = {}
    for key, template in rule["annotations"].items():
        for name, value in {**labels, **values}.items():
            template = template.replace(f"{{{{ $labels.{name} }}}}", value)
        annotations[key] = template.replace("{{ $value | humanizePercentage }}", values.get("percent", ""))
    return {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": annotations}


@pytest.mark.process
@needs_promtool
def test_the_main_alerts_fire_when_they_should_and_not_before(tmp_path: Path) -> None:
    """promtool's rule unit tests: a service refusing 10% of its answers, another 1%; demand at 1.35
    of capacity over two pods; a pod never ready."""
    quiet = {"namespace": "search", "pod": "minilm-5f7c9d8b4-q2w3e"}
    service = {"namespace": "search", "service": "bge-small"}
    tests = {
        "rule_files": ["kembed-alerts.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    series("kembed_requests_total", {**POD, "api": "grpc", "code": "OK"}, "0+100x40"),
                    series("kembed_rejected_total", {**POD, "reason": "drain_time", "priority": "batch"}, "0+10x40"),
                    series("kembed_requests_total", {**quiet, "api": "rest", "code": "200"}, "0+100x40"),
                    series("kembed_rejected_total", {**quiet, "reason": "queue_full", "priority": "batch"}, "0+1x40"),
                    series("kembed_demand_ratio", POD, "1.5x40"),
                    series("kembed_demand_ratio", OTHER_POD, "1.2x40"),
                    series("kembed_demand_ratio", quiet, "0.5x40"),
                    series("kembed_ready", POD, "1x40"),
                    series("kembed_ready", OTHER_POD, "0x40"),
                ],
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "KembedRefusingRequests", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "KembedRefusingRequests",
                        "exp_alerts": [expected("KembedRefusingRequests", service, percent="10%")],
                    },
                    {"eval_time": "10m", "alertname": "KembedDemandOverCapacity", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "KembedDemandOverCapacity",
                        "exp_alerts": [expected("KembedDemandOverCapacity", service, percent="135%")],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "KembedPodNotReady",
                        "exp_alerts": [expected("KembedPodNotReady", OTHER_POD)],
                    },
                ],
            }
        ],
    }
    (tmp_path / "kembed-alerts.yaml").write_text(yaml.safe_dump(rendered("PrometheusRule")["spec"]))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [str(PROMTOOL), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
