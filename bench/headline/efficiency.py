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
