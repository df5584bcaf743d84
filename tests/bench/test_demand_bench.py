"""bench.serving.demand's judging, on made-up outcomes: the gauge's targets and the new pod's windows."""

from __future__ import annotations

import math

import pytest

from bench.serving.demand import gauge_verdict, new_pod_figures, parse_options
from bench.tools.loadgen import OK, CallRecord

EXHAUSTED = "RESOURCE_EXHAUSTED"


def _phase(offered_x: float, reading: float, retried: bool = False) -> dict[str, object]:
    return {"offered_x": offered_x, "grpc_retry_policy": retried, "gauge": {"mean": reading}}


def test_a_proportional_gauge_meets_every_target() -> None:
    verdict = gauge_verdict([_phase(0.5, 0.5), _phase(1, 1.0), _phase(2, 2.1), _phase(4, 3.5), _phase(3, 3.0, True)])
    assert verdict["all_met"]
    assert [row["over_1x"] for row in verdict["rows"]] == [0.5, 1.0, 2.1, 3.5, 3.0]


def test_a_gauge_that_grows_faster_than_the_load_misses() -> None:
    verdict = gauge_verdict([_phase(1, 1.2), _phase(2, 3.7), _phase(3, 5.0, True)])
    assert [row["met"] for row in verdict["rows"]] == [True, False, False]


def test_the_1x_reading_itself_must_be_near_capacity() -> None:
    assert not gauge_verdict([_phase(1, 1.5)])["all_met"]


def _call(sent: float, code: str = OK) -> CallRecord:
    return CallRecord(item=0, scheduled=sent, sent=sent, done=sent + 0.01, code=code)


def test_new_pod_windows_count_refusals_early_and_compare_rates() -> None:
    outcomes = [_call(t / 10) for t in range(0, 300)]  # 10/s over the first 30 s
    outcomes += [_call(30 + t / 20) for t in range(0, 1200)]  # 20/s from 30 s to 90 s
    outcomes += [_call(10.0, EXHAUSTED), _call(70.0, EXHAUSTED)]  # one refusal inside 60 s, one after
    figures = new_pod_figures(outcomes, duration=90.0)
    assert figures["refusals_first_60_s"] == 1
    assert math.isclose(figures["emb_per_s_first_30_s"], 10.0)
    assert math.isclose(figures["emb_per_s_settled"], 20.0)
    assert figures["met"] == {"no_refusals": False, "first_30_s": False}


def test_options_refuse_a_load_too_short_for_both_windows() -> None:
    with pytest.raises(SystemExit):
        parse_options(["--new-pod-s", "60"])
