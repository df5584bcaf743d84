"""``bench/results/fleet.png``: per policy (a column), offered and refused load, the fleet's size
against the size the load needs, and the P95 against the objective, over the run.
``python -m bench.fleet.plot [NAME]`` redraws it from ``bench/results/NAME.json``."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from bench import RESULTS_DIR
from bench.fleet import judge as fleet_judge
from bench.fleet.judge import Segment
from bench.tools.machine import read_result


def main() -> None:
    """Redraw ``fleet.png`` (or ``NAME.png``) from its JSON."""
    name = sys.argv[1] if len(sys.argv) > 1 else "fleet"
    result = read_result(name)
    if result is None:
        raise SystemExit(f"no bench/results/{name}.json")
    plot(result, RESULTS_DIR / f"{name}.png")


def plot(result: dict[str, Any], path: Path) -> None:
    runs = result["policies"]
    segments = [Segment(**s) for s in result["profile"]]
    slo_ms = result["settings"]["slo_ms"]
    fig, axes = plt.subplots(3, len(runs), figsize=(5 * len(runs), 7), sharex=True, sharey="row", squeeze=False)
    for column, (name, run) in enumerate(runs.items()):
        load, size, latency = axes[:, column]
        _load(load, run, name)
        _size(size, run, segments)
        _latency(latency, run, slo_ms)
        for start, end in run["targets"]["windows"]:
            for ax in (load, size, latency):
                ax.axvspan(start, end, color="0.9", zorder=0)
    axes[-1, 0].set_xlabel(f"seconds (Kubernetes' periods / {result['settings']['compression']:g})")
    fig.suptitle("Autoscaling a kembed fleet (grey: scale-up windows)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _load(ax: Any, run: dict[str, Any], name: str) -> None:
    bins = run["per_second"]
    ts = [b["t"] for b in bins]
    ax.plot(ts, [b["offered_per_s"] for b in bins], color="tab:blue", label="offered/s")
    ax.bar(ts, [b["refused"] for b in bins], color="tab:red", width=1.0, label="refused/s")
    ax.bar(ts, [b["lost"] for b in bins], color="black", width=1.0, label="lost/s")
    targets = run["targets"]
    ax.set_title(
        f"{name}: {targets['replica_seconds_ratio']:.2f}x ideal replica-s, "
        f"{targets['slo_seconds_per_replica_second']:.3f} SLO-s per replica-s",
        fontsize=8,
    )
    _finish(ax, "calls/s")


def _size(ax: Any, run: dict[str, Any], segments: list[Segment]) -> None:
    timeline = run["timeline"]
    ts = [s["t"] for s in timeline]
    ax.step(ts, [s["replicas"] for s in timeline], where="post", color="tab:green", label="replicas (scale)")
    ax.step(ts, [s["ready"] for s in timeline], where="post", color="tab:olive", ls="--", label="ready")
    ideal = [fleet_judge.ideal_replicas(fleet_judge.level_at(segments, t)) for t in ts]
    ax.step(ts, ideal, where="post", color="0.4", ls=":", label="needed")
    _finish(ax, "replicas")


def _latency(ax: Any, run: dict[str, Any], slo_ms: float) -> None:
    bins = [b for b in run["per_second"] if not math.isnan(b["p95_ms"])]
    ax.plot([b["t"] for b in bins], [b["p95_ms"] for b in bins], color="tab:purple", label="p95 per second")
    ax.axhline(slo_ms, color="tab:red", ls=":", label="slo.p95LatencyMs")
    ax.set_yscale("log")
    _finish(ax, "ms")


def _finish(ax: Any, label: str) -> None:
    ax.set_ylabel(label, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper right")


if __name__ == "__main__":
    main()
