"""The chart's Grafana dashboard, rendered without Grafana: ``python -m bench.dashboard``.

Grafana cannot be installed here (no package in Debian, PyPI or npm carries its server), so this
draws the dashboard's own panels, each from the PromQL its JSON holds
(``charts/kembed-operator/monitoring/kembed-dashboard.json``), with matplotlib, laid out on the same
grid: a real kembed server (the bundled model, its defaults) under a little load, scraped every
second by a real Prometheus (Debian's ``prometheus``) with the ``namespace`` and ``pod`` labels a
cluster's service discovery attaches. The load, in phases: a few interactive callers, a batch ingest
beside them, a burst that admission refuses in part, then quiet. It writes ``docs/dashboard.png``
and the figures behind it to ``bench/results/dashboard.json``; about six minutes on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import re
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from bench.tools import prometheus, server, workload
from bench.tools.machine import write_result
from kembed.contract import METRICS_PATH
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from kembed_operator import monitoring

ROOT = Path(__file__).resolve().parents[1]
PICTURE = ROOT / "docs" / "dashboard.png"
NAMESPACE, SERVICE = "search", "minilm"
POD = f"{SERVICE}-7d4b9c8f6d-x2x9z"  # a Deployment's pod name: the service's, then two suffixes
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape and this range: 4 scrapes and more
STEP_S = 2
# (seconds, interactive callers, batch callers, burst calls at the phase's start)
PHASES = ((60, 4, 0, 0), (75, 4, 2, 0), (45, 2, 2, 300), (45, 1, 0, 0))
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0")


def _call(stub: pb_grpc.EmbedderStub, texts: Sequence[str], priority: pb.Priority) -> Any:
    return stub.Embed(pb.EmbedRequest(texts=list(texts), truncate=True, priority=priority), timeout=30)


async def _caller(stub: Any, texts: itertools.cycle[str], size: int, priority: pb.Priority, until: float) -> int:
    """Sends calls of ``size`` texts one after another until ``until``; a refusal waits its pushback."""
    refused = 0
    while time.monotonic() < until:
        try:
            await _call(stub, [next(texts) for _ in range(size)], priority)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused += 1
            await asyncio.sleep(1.0)
    return refused


async def _burst(stub: Any, texts: itertools.cycle[str], calls: int) -> int:
    """``calls`` calls of 16 texts at once, none retried: those admission refuses stay refused."""
    answers = await asyncio.gather(
        *(_call(stub, [next(texts) for _ in range(16)], pb.PRIORITY_BATCH) for _ in range(calls)),
        return_exceptions=True,
    )
    return sum(isinstance(answer, grpc.aio.AioRpcError) for answer in answers)


async def load(target: str, texts: Sequence[str]) -> list[dict[str, Any]]:
    """The phases, one after another; what each sent and had refused."""
    stream = itertools.cycle(texts)
    done = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        for seconds, interactive, batch, burst in PHASES:
            until = time.monotonic() + seconds
            burst_refused = await _burst(stub, stream, burst) if burst else 0
            callers = [_caller(stub, stream, 1, pb.PRIORITY_INTERACTIVE, until) for _ in range(interactive)]
            callers += [_caller(stub, stream, 32, pb.PRIORITY_BATCH, until) for _ in range(batch)]
            refused = await asyncio.gather(*callers)
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            phase = {"seconds": seconds, "interactive": interactive, "batch": batch, "burst": burst}
            done.append({**phase, "burst_refused": burst_refused, "callers_refused": sum(refused)})
    return done


def query_range(base: str, promql: str, start: float, end: float) -> list[dict[str, Any]]:
    arguments = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": STEP_S})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{arguments}", timeout=30) as reply:
        body = json.loads(reply.read())
    if body["status"] != "success":
        raise RuntimeError(f"{promql}: {body}")
    return list(body["data"]["result"])


def as_grafana_sends_it(expr: str) -> str:
    """A panel's query with the dashboard's variables as Grafana fills them for this service."""
    filled = expr.replace("$namespace", NAMESPACE).replace("$service", SERVICE)
    return filled.replace(monitoring.RATE, RATE_INTERVAL)


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def _unit(unit: str) -> FuncFormatter:
    def text(value: float, _: Any) -> str:
        if unit == "percentunit":
            return f"{value * 100:.0f}%"
        if unit == "s":
            return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
        if unit == "reqps":
            return f"{value:g} req/s"
        return f"{value / 1000:g}K" if value >= 1000 else f"{value:g}"

    return FuncFormatter(text)


def draw(board: dict[str, Any], series: dict[int, list[tuple[str, list[tuple[float, float]]]]], start: float) -> None:
    """The panels on Grafana's grid (24 columns, rows of 8 units), dark as Grafana draws them."""
    panels = board["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    figure = plt.figure(figsize=(18, 3.1 * rows / 8 + 0.9), facecolor=BACKGROUND)
    grid = figure.add_gridspec(
        rows // 8, 24 // 8, hspace=0.42, wspace=0.16, top=0.9, bottom=0.04, left=0.05, right=0.99
    )
    figure.suptitle(
        "kembed dashboard, rendered from its own panel queries against a real Prometheus scraping a real server "
        "(matplotlib, not Grafana)",
        color=TEXT,
        fontsize=12,
    )
    for panel in panels:
        where = panel["gridPos"]
        axes = figure.add_subplot(grid[where["y"] // 8, where["x"] // 8], facecolor=PANEL)
        for color, (name, points) in zip(itertools.cycle(COLORS), series[panel["id"]], strict=False):
            axes.plot([(t - start) / 60 for t, _ in points], [v for _, v in points], color=color, lw=1.4, label=name)
        axes.set_title(panel["title"], color=TEXT, fontsize=10, loc="left")
        axes.yaxis.set_major_formatter(_unit(panel["fieldConfig"]["defaults"]["unit"]))
        axes.set_ylim(bottom=0)
        axes.tick_params(colors=TEXT, labelsize=7)
        axes.grid(color=GRID, lw=0.6)
        for spine in axes.spines.values():
            spine.set_color(GRID)
        if series[panel["id"]]:
            axes.legend(fontsize=7, loc="upper left", facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, ncol=3)
        else:
            axes.text(0.5, 0.5, "No data", color=TEXT, ha="center", va="center", transform=axes.transAxes)
        if where["y"] // 8 == rows // 8 - 1:
            axes.set_xlabel("minutes", color=TEXT, fontsize=8)
    PICTURE.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(PICTURE, dpi=72, facecolor=BACKGROUND)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    board = json.loads((ROOT / monitoring.DASHBOARD).read_text())
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        running = stack.enter_context(server.running({}, work / "server.log", start_timeout=900))
        scrape = {
            "job_name": "kembed",
            "metrics_path": METRICS_PATH,
            "static_configs": [
                {
                    "targets": [urllib.parse.urlsplit(running.http_url).netloc],
                    "labels": {"namespace": NAMESPACE, "pod": POD},
                }
            ],
        }
        base = stack.enter_context(prometheus.running(work, [scrape]))
        start = time.time()
        phases = asyncio.run(load(running.grpc_target, workload.corpus()))
        time.sleep(3 * STEP_S)  # the last scrapes
        end = time.time()
        series: dict[int, list[tuple[str, list[tuple[float, float]]]]] = {}
        for panel in board["panels"]:
            series[panel["id"]] = [
                (legend(target["legendFormat"], result["metric"]), _points(result["values"]))
                for target in panel["targets"]
                for result in query_range(base, as_grafana_sends_it(target["expr"]), start, end)
            ]
    draw(board, series, start)
    summary = {
        title: {name: round(max((v for _, v in points), default=0.0), 4) for name, points in lines}
        for title, lines in ((p["title"], series[p["id"]]) for p in board["panels"])
    }
    write_result("dashboard", {"phases": phases, "peaks": summary, "picture": str(PICTURE.relative_to(ROOT))})
    return 0


def _points(values: list[tuple[float, str]]) -> list[tuple[float, float]]:
    """A range query's samples; NaN (a ratio over no tokens yet) as a gap."""
    return [(float(t), float(v)) for t, v in values if math.isfinite(float(v))]


if __name__ == "__main__":
    raise SystemExit(main())
