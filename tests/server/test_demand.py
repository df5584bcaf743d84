"""The offered demand (kembed/policy/demand.py): its arithmetic on a fake clock, a modeled pod offered its
capacity, and the screen counting each call once, summed over a pod's front ends as /metrics reads it."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kembed.config.settings import Settings
from kembed.frontend.outbox import InTransit
from kembed.frontend.screen import Screen, Waits
from kembed.ipc.board import Board, Cell
from kembed.metrics import demand_ratio
from kembed.policy.admission import Rejection
from kembed.policy.demand import Capacity, OfferedRate, decayed, ratio, retry_attempt
from kembed.policy.load import MeasuredLoad
from kembed.policy.priority import Priority

RATE = 1000.0  # padded tokens a second the modeled pod serves
TAU_S = Settings().demand_window_s
COST = 128


def test_a_steady_flow_reads_its_rate_and_a_pause_decays_it() -> None:
    offered = OfferedRate(TAU_S)
    for tick in range(1, 10 * int(TAU_S) * 10 + 1):  # 10 calls a second of COST, for ten time constants
        offered.add(COST, tick / 10)
    now = offered.at
    assert decayed(offered.rate, offered.at, now, TAU_S) == pytest.approx(10 * COST, rel=0.01)
    assert decayed(offered.rate, offered.at, now + TAU_S, TAU_S) == pytest.approx(10 * COST / math.e, rel=0.01)
    assert decayed(offered.rate, offered.at, now - 1, TAU_S) == offered.rate  # a reader behind never inflates it


def test_the_ratio_sums_front_ends_and_divides_at_the_end() -> None:
    first, second = OfferedRate(TAU_S), OfferedRate(TAU_S)
    first.add(TAU_S * 300, 5.0)  # 300 tokens a second, as its weight says
    second.add(TAU_S * 200, 5.0)
    pairs = [(first.rate, first.at), (second.rate, second.at)]
    assert ratio(pairs, 5.0, capacity=1000.0, tau_s=TAU_S) == pytest.approx(0.5)
    assert ratio(pairs, 5.0, capacity=0.0, tau_s=TAU_S) == 0.0  # no measured rate yet: nothing to say


def test_a_modeled_pod_offered_its_capacity_reads_about_one() -> None:
    """Poisson arrivals whose padded tokens add up to the pod's rate on average: the gauge reads
    about 1 once the weighting has filled, whatever share of the calls the pod refuses."""
    rng, offered, now = random.Random(7), OfferedRate(TAU_S), 0.0
    calls_per_s = RATE / COST
    readings = []
    while now < 20 * TAU_S:
        now += rng.expovariate(calls_per_s)
        offered.add(COST, now)
        if now > 4 * TAU_S:
            readings.append(ratio([(offered.rate, offered.at)], now, RATE, TAU_S))
    assert sum(readings) / len(readings) == pytest.approx(1.0, abs=0.03)
    assert min(readings) > 0.7 and max(readings) < 1.3  # its noise, with this seed: no reading doubles a pod count


def lull_then_overload(load: MeasuredLoad, clock: Clock) -> Iterator[tuple[str, float]]:
    """A pod seeded at 4,000 tokens/s by warmup: a minute of one-text batches (400 tokens/s), then
    a minute of full batches slowed to 2,000 tokens/s by the refusals' work; the capacity read at
    the end of each, as the engine publishes it at every tick."""
    load.rate.seed(tokens=4000, seconds=1.0)
    for phase, tokens, seconds, per_s in (("lull", 16, 0.04, 25), ("overload", 2048, 1.024, 1)):
        for _ in range(60 * per_s):
            clock.now += 1 / per_s
            load.rate.record(tokens, seconds)
            load.capacity()
        yield phase, load.capacity()


def test_the_capacity_holds_through_a_lull_and_an_overload() -> None:
    """The measured service rate falls in both (the demand divided by it read 0.69x at half load and
    3x at twice the load); the capacity the demand divides by stays within 20% of what warmup measured."""
    clock = Clock()
    load = MeasuredLoad(Settings(), clock=clock, batch_tokens=2048)
    for phase, capacity in lull_then_overload(load, clock):
        assert load.tokens_per_second < 0.6 * 4000, phase  # the rate of the moment fell
        assert capacity > 0.8 * 4000, phase


def test_the_capacity_rises_at_once_and_forgets_a_lasting_fall() -> None:
    capacity = Capacity(hold_s=300.0)
    assert capacity.update(1000.0, 0.0) == 1000.0
    assert capacity.update(3000.0, 1.0) == 3000.0  # the pod showed it can do more
    assert capacity.update(1000.0, 301.0) == pytest.approx(1000 + 2000 / math.e)  # one hold later
    assert capacity.update(1000.0, 3000.0) == pytest.approx(1000.0, rel=0.01)  # a slower node, for good


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
    board[Cell.TOKENS_PER_SECOND] = board[Cell.CAPACITY] = RATE
    settings = Settings.from_env({}, max_drain_ms=1000, admission="throughput")
    clock = Clock()

    def refusals(spared_seconds: float, priority: Priority) -> None:
        pass

    yield (
        Screen(settings, board, 0, InTransit(lambda: 0), refusals, clock),
        Screen(settings, board, 1, InTransit(lambda: 0), refusals, clock),
        board,
        clock,
    )


def test_each_call_counts_once_at_the_step_that_decides_it(tmp_path: Path) -> None:
    with screens(tmp_path) as (screen, _, board, clock):
        unit = COST / TAU_S / RATE  # one call of COST, read at once
        assert isinstance(screen.after_tokenizing(COST, Priority.INTERACTIVE), Waits)  # admitted: counted at its cost
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(unit)
        board[Cell.IN_FLIGHT_TOKENS] = 4000  # four seconds of work: refusals
        assert screen.before_tokenizing(COST, Priority.BATCH) is not None  # refused before tokenizing
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(2 * unit)
        assert screen.before_tokenizing(COST, Priority.BATCH, attempt=1) is not None  # its retry
        assert isinstance(screen.after_tokenizing(COST, Priority.BATCH, attempt=2), Rejection)
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(2 * unit)  # counted at its first attempt only
        assert screen.before_tokenizing(COST, Priority.BATCH, seconds_left=1.0) is not None  # or in its deadline
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(3 * unit)
        board[Cell.IN_FLIGHT_TOKENS] = 0
        assert screen.before_tokenizing(COST, Priority.BATCH) is None  # passed: counted once it is costed
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(3 * unit)


def test_a_pods_front_ends_add_up_and_a_restarted_one_carries_on(tmp_path: Path) -> None:
    with screens(tmp_path) as (first, second, board, clock):
        first.offer(COST, 0)
        second.offer(3 * COST, 0)
        clock.now += TAU_S
        expected = 4 * COST / TAU_S / RATE / math.e
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(expected)
        settings = Settings.from_env({}, admission="throughput")
        Screen(settings, board, 1, InTransit(lambda: 0), lambda *_: None, clock)  # front end 1 restarted
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(expected)


def test_a_call_no_pod_could_serve_in_its_deadline_counts_nothing(tmp_path: Path) -> None:
    """1,024 one-letter texts after a 250-token prompt, a 3.6 KB message, with a 1 s deadline: 262,144
    padded tokens no pod could compute in a second. Each counted its whole bound, and 20 a second
    moved the gauge from 0 to 784. Refused before tokenizing or after, it counts nothing; a call
    refused for the work ahead of it, which another pod could have served, counts."""
    with screens(tmp_path) as (screen, _, board, clock):
        bound = 1024 * 256
        for _ in range(400):  # 20 a second for 20 s
            clock.now += 0.05
            assert screen.before_tokenizing(bound, Priority.BATCH, seconds_left=1.0) is not None
        rejection = screen.after_tokenizing(bound, Priority.BATCH, seconds_left=1.0)
        assert isinstance(rejection, Rejection) and rejection.reason == "deadline"
        assert demand_ratio(board, clock.now, TAU_S) == 0.0
        board[Cell.IN_FLIGHT_TOKENS] = 4000  # four seconds of work ahead
        assert screen.before_tokenizing(COST, Priority.BATCH, seconds_left=1.0) is not None
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(COST / TAU_S / RATE)


def test_calls_marked_as_retries_read_as_the_work_they_are_admitted_to(tmp_path: Path) -> None:
    """A client marking every call a retry read 0.03-0.06 while the engine kept computing: a marker
    spares a refused retry, never the work the pod is given."""
    with screens(tmp_path) as (screen, _, board, clock):
        for _ in range(10 * int(TAU_S) * 8):  # the pod's rate in admitted calls, for eight time constants
            clock.now += COST / RATE
            assert isinstance(screen.after_tokenizing(COST, Priority.INTERACTIVE, attempt=1), Waits)
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(1.0, rel=0.01)
        board[Cell.IN_FLIGHT_TOKENS] = 4000
        for _ in range(1000):  # marked refusals count nothing more
            assert screen.before_tokenizing(COST, Priority.BATCH, attempt=1) is not None
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(1.0, rel=0.01)


def test_offered_work_over_the_admitted_reads_as_offered(tmp_path: Path) -> None:
    """The larger of the two: three times the pod's rate offered, a third of it admitted, reads 3."""
    with screens(tmp_path) as (screen, _, board, clock):
        for call in range(3 * 10 * int(TAU_S) * 8):
            clock.now += COST / RATE / 3
            if call % 3:
                screen.offer(COST, 0)  # refused
            else:
                assert isinstance(screen.after_tokenizing(COST, Priority.INTERACTIVE), Waits)
        assert demand_ratio(board, clock.now, TAU_S) == pytest.approx(3.0, rel=0.01)
