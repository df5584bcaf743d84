"""The offered demand (kembed/demand.py): its arithmetic on a fake clock, a modeled pod offered its
capacity, and the screen counting each call once, summed over a pod's front ends as /metrics reads it."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kembed.board import Board, Cell
from kembed.config import Settings
from kembed.demand import DEMAND_TAU_S, OfferedRate, decayed, ratio, retry_attempt
from kembed.frontend.outbox import InTransit
from kembed.frontend.screen import Screen
from kembed.metrics import demand_ratio
from kembed.priority import Priority

RATE = 1000.0  # padded tokens a second the modeled pod serves
COST = 128


def test_a_steady_flow_reads_its_rate_and_a_pause_decays_it() -> None:
    offered = OfferedRate()
    for tick in range(1, 10 * int(DEMAND_TAU_S) * 10 + 1):  # 10 calls a second of COST, for ten time constants
        offered.add(COST, tick / 10)
    now = offered.at
    assert decayed(offered.rate, offered.at, now) == pytest.approx(10 * COST, rel=0.01)
    assert decayed(offered.rate, offered.at, now + DEMAND_TAU_S) == pytest.approx(10 * COST / math.e, rel=0.01)
    assert decayed(offered.rate, offered.at, now - 1) == offered.rate  # a reader a moment behind never inflates it


def test_the_ratio_sums_front_ends_and_divides_at_the_end() -> None:
    first, second = OfferedRate(), OfferedRate()
    first.add(DEMAND_TAU_S * 300, 5.0)  # 300 tokens a second, as its weight says
    second.add(DEMAND_TAU_S * 200, 5.0)
    pairs = [(first.rate, first.at), (second.rate, second.at)]
    assert ratio(pairs, 5.0, capacity=1000.0) == pytest.approx(0.5)
    assert ratio(pairs, 5.0, capacity=0.0) == 0.0  # no measured rate yet: nothing to say


def test_a_modeled_pod_offered_its_capacity_reads_about_one() -> None:
    """Poisson arrivals whose padded tokens add up to the pod's rate on average: the gauge reads
    about 1 once the weighting has filled, whatever share of the calls the pod refuses."""
    rng, offered, now = random.Random(7), OfferedRate(), 0.0
    calls_per_s = RATE / COST
    readings = []
    while now < 20 * DEMAND_TAU_S:
        now += rng.expovariate(calls_per_s)
        offered.add(COST, now)
        if now > 4 * DEMAND_TAU_S:
            readings.append(ratio([(offered.rate, offered.at)], now, RATE))
    assert sum(readings) / len(readings) == pytest.approx(1.0, abs=0.03)
    assert min(readings) > 0.7 and max(readings) < 1.3  # its noise, with this seed: no reading doubles a pod count


def test_retry_markers_read_as_earlier_attempts() -> None:
    assert [retry_attempt(v) for v in (None, "0", "1", b"3", "-2", "x", "")] == [0, 0, 1, 3, 0, 0, 0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def screens(tmp_path: Path) -> Iterator[tuple[Screen, Screen, Board, Clock]]:
    """Two front ends' screens over one board, the engine at RATE and a drain budget of 1 s."""
    board = Board(tmp_path / "board", frontends=2)
    board[Cell.TOKENS_PER_SECOND] = RATE
    settings = Settings.from_env({}, max_drain_ms=1000, admission="throughput")
    clock = Clock()

    def refusals(spared_seconds: float, priority: Priority) -> None:
        pass

    yield (
        Screen(settings, board, 0, InTransit(), refusals, clock),
        Screen(settings, board, 1, InTransit(), refusals, clock),
        board,
        clock,
    )


def test_each_call_counts_once_at_the_step_that_decides_it(tmp_path: Path) -> None:
    with screens(tmp_path) as (screen, _, board, clock):
        unit = COST / DEMAND_TAU_S / RATE  # one call of COST, read at once
        assert screen.after_tokenizing(COST, Priority.INTERACTIVE) is None  # admitted: counted at its cost
        assert demand_ratio(board, clock.now) == pytest.approx(unit)
        board[Cell.IN_FLIGHT_TOKENS] = 4000  # four seconds of work: refusals
        assert screen.before_tokenizing(COST, Priority.BATCH) is not None  # refused before tokenizing
        assert demand_ratio(board, clock.now) == pytest.approx(2 * unit)
        assert screen.before_tokenizing(COST, Priority.BATCH, attempt=1) is not None  # its retry
        assert screen.after_tokenizing(COST, Priority.BATCH, attempt=2) is not None
        assert demand_ratio(board, clock.now) == pytest.approx(2 * unit)  # counted at its first attempt only
        assert screen.in_time(COST, Priority.BATCH, 0.001) is not None  # cannot be served in its deadline
        assert demand_ratio(board, clock.now) == pytest.approx(3 * unit)
        board[Cell.IN_FLIGHT_TOKENS] = 0
        assert screen.before_tokenizing(COST, Priority.BATCH) is None  # passed: counted once it is costed
        assert demand_ratio(board, clock.now) == pytest.approx(3 * unit)


def test_a_pods_front_ends_add_up_and_a_restarted_one_carries_on(tmp_path: Path) -> None:
    with screens(tmp_path) as (first, second, board, clock):
        first.offer(COST, 0)
        second.offer(3 * COST, 0)
        clock.now += DEMAND_TAU_S
        expected = 4 * COST / DEMAND_TAU_S / RATE / math.e
        assert demand_ratio(board, clock.now) == pytest.approx(expected)
        settings = Settings.from_env({}, admission="throughput")
        Screen(settings, board, 1, InTransit(), lambda *_: None, clock)  # front end 1 restarted
        assert demand_ratio(board, clock.now) == pytest.approx(expected)
