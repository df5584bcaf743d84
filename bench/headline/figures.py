"""The cells every headline table shares: a phase's rates, an exact figure as a spread, milliseconds
and cores as text."""

from __future__ import annotations

import math
from typing import Any

from bench.tools.report import Spread


def emb_rate(phase: dict[str, Any]) -> Spread:
    return Spread.from_dict(phase["emb_per_s"])


def exact(value: float) -> Spread:
    return Spread(value, value, value)


def ms_text(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0f}"


def cores_text(cores: dict[str, float] | None) -> str:
    return f"{cores['server']:.2f} / {cores['client']:.2f}" if cores else "—"


def calls_rate(phase: dict[str, Any]) -> Spread:
    return Spread.from_dict(phase["calls_per_s"])
