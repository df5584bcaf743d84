"""Both admission strategies and the queue cap, driven by a fake clock."""

import random

import pytest

from kembed.admission import MIN_LATENCY_SAMPLES, P95_CACHE_S, AdmissionController, MeasuredLoad
from kembed.config import Settings


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(clock: FakeClock, **settings) -> tuple[AdmissionController, MeasuredLoad]:
    """The engine's pairing: the rules over its own measurements."""
    configured = Settings(**settings)
    load = MeasuredLoad(configured, clock=clock)
    return AdmissionController(configured, load, rng=random.Random(7)), load


def test_no_rate_yet_admits_within_the_cap():
    admission, _ = controller(FakeClock(), max_queued_tokens=1000)
    assert admission.admit(500, backlog_tokens=400) is None
    rejection = admission.admit(500, backlog_tokens=600)
    assert rejection is not None and rejection.reason == "queue_full"


def test_throughput_rejects_when_the_backlog_would_not_drain_in_budget():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000, batching="naive")
    load.rate.seed(tokens=10_000, seconds=1.0)  # warmup: 10k tokens/s
    assert admission.admit(1000, backlog_tokens=8000) is None  # 0.9 s
    rejection = admission.admit(1000, backlog_tokens=9500)  # 1.05 s
    assert rejection is not None and rejection.reason == "drain_time"
    assert "drain budget" in rejection.message


def test_buckets_budget_the_longest_wait_not_the_average():
    """A request that just missed its bucket's turn waits about twice the drain time."""
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=10_000, seconds=1.0)
    assert admission.admit(1000, backlog_tokens=3500) is None  # drains in 0.45 s, waits up to 0.9 s
    assert admission.admit(1000, backlog_tokens=5000) is not None  # drains in 0.6 s, may wait 1.2 s


def test_pushback_is_the_backlog_drain_time_jittered():
    """Not just the excess: clients told to come back in milliseconds all come back at once."""
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000, batching="naive")
    load.rate.seed(tokens=10_000, seconds=1.0)
    rejections = [admission.admit(1000, backlog_tokens=9500) for _ in range(200)]
    pushbacks = [r.retry_after_ms for r in rejections if r is not None]
    assert len(pushbacks) == 200
    assert min(pushbacks) >= 525 and max(pushbacks) <= 1575  # 1.05 s, +-50%
    assert max(pushbacks) - min(pushbacks) > 500  # spread, so retries do not arrive together


def test_rate_follows_completed_batches_not_the_seed():
    admission, load = controller(FakeClock(), admission=["throughput"])
    load.rate.seed(tokens=100_000, seconds=1.0)  # an optimistic warmup
    for _ in range(100):
        load.rate.record(tokens=1000, seconds=1.0)  # what the model really does
    assert load.rate.tokens_per_second == pytest.approx(1000, rel=0.01)
    assert admission.drain_seconds(5000) == pytest.approx(5.0, rel=0.01)


def test_latency_strategy_needs_a_few_samples_then_sheds_by_fraction():
    clock = FakeClock()
    admission, load = controller(clock, admission=["latency"], p95_soft_ms=100, p95_hard_ms=300)
    for _ in range(MIN_LATENCY_SAMPLES - 1):
        load.latency.add(0.2)
    assert load.shed_fraction() == 0.0
    load.latency.add(0.2)
    clock.now += 1
    expected = (0.2 - 0.08) / (0.3 - 0.08)  # linear from the recovery floor (80% of soft) to hard
    assert load.shed_fraction() == pytest.approx(expected)
    load.rate.seed(tokens=100, seconds=1.0)
    outcomes = [admission.screen(10, 10) for _ in range(2000)]  # a rejection would have taken 0.2 s
    shed = sum(o is not None for o in outcomes) / len(outcomes)
    assert expected - 0.07 < shed < expected + 0.07
    assert {o.reason for o in outcomes if o} == {"latency_shed"}


def test_latency_hard_limit_rejects_everything_that_would_queue():
    """Work-conserving: a P95 over the limit never refuses a request that would not queue, since
    that only idles the worker."""
    clock = FakeClock()
    admission, load = controller(clock, admission=["latency"], p95_soft_ms=100, p95_hard_ms=300)
    load.rate.seed(tokens=1000, seconds=1.0)
    for _ in range(20):
        load.latency.add(0.5)
    assert load.shed_fraction() == 1.0
    assert admission.admit(10, 1000) is None  # the latency draw happens once, before tokenizing
    rejection = admission.screen(10, 1000)
    assert rejection is not None and rejection.reason == "latency_hard"
    assert rejection.retry_after_ms >= 10
    assert admission.screen(10, 0) is None  # waits at most 20 ms, under the 80 ms recovery floor


def test_shedding_has_hysteresis_and_recovers_as_the_window_slides():
    clock = FakeClock()
    _, load = controller(clock, admission=["latency"], p95_soft_ms=100, p95_hard_ms=300, latency_window_s=5)
    for _ in range(20):
        load.latency.add(0.15)
    assert load.shed_fraction() > 0 and load.shedding
    clock.now += 6  # the slow samples leave the window
    for _ in range(20):
        load.latency.add(0.09)  # under soft, but above 80% of it: still shedding, a little
    clock.now += 0.1
    assert 0 < load.shed_fraction() < 0.1 and load.shedding
    clock.now += 6
    for _ in range(20):
        load.latency.add(0.05)
    clock.now += 0.1
    assert load.shed_fraction() == 0.0 and not load.shedding


def test_rejections_count_in_the_window_at_the_wait_they_were_spared():
    clock = FakeClock()
    admission, load = controller(clock, admission=["throughput", "latency"], max_drain_ms=1000, p95_soft_ms=500)
    load.rate.seed(tokens=1000, seconds=1.0)
    for _ in range(10):
        assert admission.admit(500, backlog_tokens=1000) is not None  # would have taken 1.5 s
    clock.now += 1
    assert load.p95_seconds() == pytest.approx(1.5)
    assert load.shed_fraction() > 0  # the rejections alone push the P95 over the soft limit


def test_no_strategies_still_bounds_the_queue():
    admission, load = controller(FakeClock(), admission="", max_queued_tokens=100)
    load.rate.seed(tokens=1, seconds=100.0)
    assert admission.admit(50, 0) is None
    rejection = admission.admit(50, 60)
    assert rejection is not None
    assert rejection.reason == "queue_full"


def test_screening_refuses_overload_before_the_exact_cost_is_known():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=1000, seconds=1.0)
    assert admission.screen(16, backlog_tokens=400) is None  # a lower bound that still fits
    assert admission.admit(256, backlog_tokens=400) is not None  # the exact cost does not
    rejection = admission.screen(16, backlog_tokens=500)
    assert rejection is not None
    assert rejection.reason == "drain_time"


def test_p95_is_recomputed_at_most_every_cache_period_however_many_samples_arrive():
    """Under overload every request adds a sample; recomputing per request cost more than serving it."""
    clock = FakeClock()
    _, load = controller(clock, admission=["latency"])
    for _ in range(MIN_LATENCY_SAMPLES):
        load.latency.add(0.1)
    assert load.p95_seconds() == pytest.approx(0.1)
    for _ in range(100):
        load.latency.add(5.0)
    assert load.p95_seconds() == pytest.approx(0.1)  # cached
    clock.now += P95_CACHE_S
    assert load.p95_seconds() == pytest.approx(5.0)
