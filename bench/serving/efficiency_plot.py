"""The CPU account of ``bench.serving.efficiency`` as bars: a served embedding's CPU by part, per
model and load, beside the model's own in one process.

``python -m bench.serving.efficiency_plot [NAME]`` redraws it from ``bench/results/NAME.json``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from bench import RESULTS_DIR
from bench.tools.machine import read_result

FORWARD = ("forward", "pooling")
HAND_OFF = ("worker hand-off", "batch assembly", "batch formation")
PARTS = ("forward and pooling", "hand-off and batches", "engine loop", "front end", "supervisor")
COLORS = ("tab:blue", "tab:cyan", "tab:orange", "tab:red", "tab:gray")


def parts(load: dict[str, Any]) -> dict[str, float]:
    """CPU ms per embedding by part: the engine's stages split three ways, the other processes whole;
    a refused call's CPU is spread over the embeddings served, as ``server_cpu_ms_per_emb`` counts it."""
    stages, processes = load["cpu_ms_per_call_by_stage"], load["cpu_ms_per_call_by_process"]
    forward = sum(stages.get(s, 0.0) for s in FORWARD)
    hand_off = sum(stages.get(s, 0.0) for s in HAND_OFF)
    engine = processes.get("engine", 0.0)
    front = sum(ms for role, ms in processes.items() if role.startswith("frontend"))
    per_call = (forward, hand_off, engine - forward - hand_off, front, processes.get("supervisor", 0.0))
    per_emb = load["server_cpu_ms_per_emb"] / sum(per_call)
    return dict(zip(PARTS, (ms * per_emb for ms in per_call), strict=True))


def plot(result: dict[str, Any], path: Path) -> None:
    rows = [(f"{m['model']}, {load['load']}", parts(load), m["own"]["own"]["cpu_ms_per_emb"])
            for m in result["models"] for load in m["loads"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    for y, (_, split, own) in enumerate(rows):
        left = 0.0
        for part, color in zip(PARTS, COLORS, strict=True):
            ax.barh(y, split[part], left=left, color=color, label=part if y == 0 else None)
            left += split[part]
        ax.plot([own, own], [y - 0.4, y + 0.4], color="black", label="the model's own" if y == 0 else None)
    ax.set_yticks(range(len(rows)), [name for name, _, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("CPU ms per embedding (load TEXTSxCALLERS)")
    ax.set_title(f"Where a served embedding's CPU goes ({result['machine']['cpu']})", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "efficiency"
    result = read_result(name)
    if result is None:
        sys.exit(f"no {RESULTS_DIR / name}.json: run python -m bench.serving.efficiency")
    plot(result, RESULTS_DIR / f"{name}.png")
