"""The serving efficiency's figures (``bench.serving.efficiency``): the server's CPU per embedding over
the model's own, its emb/s over sentence-transformers' encode, and a refusal's front-end CPU over a
served call's, per model."""

from __future__ import annotations

from typing import Any

from bench.headline.figures import emb_rate, exact
from bench.tools.report import Ratio

CPU_OVER_OWN_TARGET = "<= 1.25"  # 32 callers of one text
OVER_ST_TARGET = ">= 1.10"  # 32 callers of one text
REFUSAL_TARGET = "<= 0.50"  # a refusal's front-end CPU over a served one-text call's
JUDGED_LOAD = "1x32"


def efficiency_ratios(result: dict[str, Any]) -> list[Ratio]:
    rows = []
    for model in result["models"]:
        name, own = model["model"], model["own"]
        for load in model["loads"]:
            judged = load["load"] == JUDGED_LOAD
            rows.append(
                Ratio(
                    f"{name}, {_load_text(load['load'])}: server CPU per embedding / the model's own "
                    f"({own['own']['name']}, {own['dtype']})",
                    exact(load["server_cpu_ms_per_emb"] / own["own"]["cpu_ms_per_emb"]),
                    CPU_OVER_OWN_TARGET if judged else "",
                )
            )
            rows.append(
                Ratio(
                    f"{name}, {_load_text(load['load'])}: emb/s / sentence-transformers encode "
                    f"({own['st_encode']['name'].removeprefix('st_encode_')})",
                    emb_rate(load).over(exact(own["st_encode"]["emb_per_s"])),
                    OVER_ST_TARGET if judged else "",
                )
            )
        if refusals := model.get("refusals"):
            rows.append(
                Ratio(
                    f"{name}: a refusal's front-end CPU / a served one-text call's",
                    exact(refusals["frontend_over_served_call"]),
                    REFUSAL_TARGET,
                )
            )
    return rows


def _load_text(load: str) -> str:
    texts, callers = load.split("x")
    return f"{callers} callers of {texts} text{'s' if texts != '1' else ''}"


# A 16-core GPU host as KEMBED_FRONTENDS=auto sizes it (docs/decisions/cpu-sizing.md): 7 front ends,
# the engine's event loop on a core of its own; the device's own rate from GPU.md's in-process ceiling.
GPU_HOST_FRONTENDS = 7
GPU_DEVICE_EMB_PER_S = 46_000.0  # MiniLM-L6, bf16, compiled, bucketed shapes, H100 (GPU.md)


def gpu_projection(
    model: dict[str, Any], frontends: int = GPU_HOST_FRONTENDS, device_emb_per_s: float = GPU_DEVICE_EMB_PER_S
) -> list[dict[str, Any]]:
    """Per load, the calls/s and emb/s a GPU host would serve from this run's host costs at this
    CPU's speed: each front end's CPU per call (all front ends' processes, one core each), the
    engine's event loop's (its main thread, one core), and the device's rate: the least of the three.
    The lanes' compute is the CPU's and is left out: on a GPU host the device computes."""
    rows = []
    for load in model["loads"]:
        texts = int(load["load"].split("x")[0])
        per_call = load["cpu_ms_per_call_by_thread"]
        frontend_ms = sum(ms for thread, ms in per_call.items() if thread.startswith("frontend"))
        loop_ms = per_call.get("engine: MainThread", float("nan"))
        limits = {
            "front ends": frontends * 1000 / frontend_ms,
            "engine loop": 1000 / loop_ms,
            "device": device_emb_per_s / texts,
        }
        bound = min(limits, key=lambda k: limits[k])
        calls = limits[bound]
        rows.append({"load": load["load"], "frontend_ms_per_call": frontend_ms, "engine_loop_ms_per_call": loop_ms,
                     "calls_per_s": calls, "emb_per_s": calls * texts, "bound_by": bound,
                     "limits_calls_per_s": limits})  # fmt: skip
    return rows
