"""The fleet bench's modeled device: its cost line, fitted to a batch curve (no server)."""

from __future__ import annotations

import pytest

from bench.fleet.device import Cost, fit


def test_the_device_cost_is_the_line_through_a_batch_curve() -> None:
    true = Cost(0.01, 0.0001)  # 10 ms a batch plus 0.1 ms a token
    points = [{"tokens": t, "tokens_per_s": t / true.seconds(t // 64, 64)} for t in (64, 256, 1024, 4096)]
    fitted = fit(points)
    assert fitted.overhead_s == pytest.approx(0.01) and fitted.per_token_s == pytest.approx(0.0001)
    assert fitted.slowed(8).seconds(2, 64) == pytest.approx(8 * (0.01 + 0.0001 * 128))
    assert Cost.from_env({"FLEET_DEVICE_COST": fitted.env()}) == fitted
