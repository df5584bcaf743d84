"""bench.serving.attacks' pieces without a server: the attacker's body is the issue's, and the
verdicts read the bystander's OK share, its kept calls/s and the gauge against the served load."""

from __future__ import annotations

import json
from typing import Any

from bench.serving import attackers, attacks


def test_the_large_body_is_the_issues() -> None:
    body = attackers.big_body()
    assert 900_000 < len(body) < 950_000 and len(json.loads(body)["input"]) == 1024


def phase(ok_per_s: float, ok_share: float = 1.0, demand: float = 1.0, served: float = 1.0) -> dict[str, Any]:
    kind = {"calls": 100, "ok_share": ok_share, "ok_per_s": ok_per_s, "codes": {}}
    return {"bystander": {"grpc": kind, "rest": kind}, "demand_ratio": demand, "served_ratio": served}


def test_the_verdicts() -> None:
    kept = attacks._judged(phase(80.0), phase(41.0, ok_share=0.95), "silent")
    assert kept["grpc"] == {"ok_share": 0.95, "kept_calls_per_s": 0.51, "met": True}
    assert not attacks._judged(phase(80.0), phase(39.0), "heads")["rest"]["met"]  # under half its calls/s
    assert not attacks._judged(phase(80.0), phase(80.0, ok_share=0.89), "heads")["rest"]["met"]
    # The gauge's unit: the bystander alone reads 1.8 times its served load.
    gauge = attacks._judged(phase(80.0, demand=0.9, served=0.5), phase(80.0, demand=2.16, served=1.0), "inflate")
    assert gauge["gauge"] == {"off_by": 0.2, "met": True}
    deflated = attacks._judged(phase(80.0), phase(10.0, demand=0.05, served=0.9), "deflate")
    assert set(deflated) == {"gauge"} and not deflated["gauge"]["met"]  # a saturating client: the gauge alone
