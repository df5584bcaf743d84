"""/health's ``saturated``: the refusals the edges answered in the last window, from samples of
their running counters (kembed.supervisor.refusals), with a fake clock. A real burst refused:
test_overload."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kembed.contract import Metric
from kembed.supervisor.refusals import WINDOW_S, Answers, RecentRefusals, counted


class Totals:
    def __init__(self) -> None:
        self.now = 0.0
        self.answers = Answers(0, 0)

    def add(self, answered: float, refused: float) -> None:
        self.answers = Answers(self.answers.answered + answered, self.answers.refused + refused)


def test_refusals_count_for_one_window_then_age_out():
    totals = Totals()
    recent = RecentRefusals(lambda: totals.answers, clock=lambda: totals.now)
    assert recent.recent() == (0, 0)
    for _ in range(5):  # a burst: 100 answers, 96 of them refusals
        totals.now += 1
        totals.add(20, 19.2)
        recent.sample()
    assert recent.recent() == (100, 96)
    totals.now += WINDOW_S - 1  # the burst's last samples are still in the window
    assert recent.recent().refused > 0
    for _ in range(int(WINDOW_S) + 2):  # served calls only, a window and more
        totals.now += 1
        totals.add(10, 0)
        recent.sample()
    assert recent.recent() == (100, 0)  # the last 10 s: ten samples of 10 answers, none refused


def test_the_edges_answers_are_read_off_the_registry():
    registry = CollectorRegistry()
    requests = Counter(Metric.REQUESTS, "answers", ["api", "code"], registry=registry)
    requests.labels(api="grpc", code="OK").inc(7)
    requests.labels(api="grpc", code="RESOURCE_EXHAUSTED").inc(3)
    requests.labels(api="rest", code="429").inc(2)
    requests.labels(api="rest", code="400").inc(1)
    assert counted(registry) == Answers(13, 5)
