"""Both admission strategies, the queue cap and the priority classes, driven by a fake clock."""

import random

import numpy as np
import pytest

from kembed.config.settings import Settings
from kembed.policy.admission import INTERACTIVE_RESERVE, AdmissionController, Backlog, Rejection, lapsing
from kembed.policy.load import MAX_LATENCY_SAMPLES, MIN_LATENCY_SAMPLES, P95_CACHE_S, LatencyWindow, MeasuredLoad
from kembed.policy.priority import Priority

INTERACTIVE, BATCH = Priority


def reason(rejection: Rejection | None) -> str | None:
    return None if rejection is None else rejection.reason


def queued(tokens: int) -> Backlog:
    """A backlog of interactive work alone: what every request met before there were classes."""
    return Backlog(interactive=tokens)


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
    assert admission.admit(500, Backlog(batch=400), BATCH) is None
    rejection = admission.admit(500, Backlog(batch=600), BATCH)
    assert rejection is not None and rejection.reason == "queue_full"


def test_throughput_rejects_when_the_backlog_would_not_drain_in_budget():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000, batching="naive")
    load.rate.seed(tokens=10_000, seconds=1.0)  # warmup: 10k tokens/s
    assert admission.admit(1000, queued(8000), INTERACTIVE) is None  # 0.9 s
    rejection = admission.admit(1000, queued(9500), INTERACTIVE)  # 1.05 s
    assert rejection is not None and rejection.reason == "drain_time"
    assert "drain budget" in rejection.message


def test_a_deadline_shorter_than_the_wait_ahead_is_refused_and_only_with_the_throughput_rule():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=2000)
    load.rate.seed(tokens=10_000, seconds=1.0)
    backlog = Backlog(interactive=3000, batch=50_000)  # a query waits behind 0.3 s, not the ingest
    assert admission.in_time(100, backlog, INTERACTIVE, seconds_left=0.5) is None
    late = admission.in_time(100, backlog, INTERACTIVE, seconds_left=0.2)
    assert late is not None and late.reason == "deadline" and late.retry_after_ms > 0
    assert "310 ms exceeds the call's 200 ms deadline" in late.message
    assert reason(admission.in_time(100, backlog, BATCH, seconds_left=1.0)) == "deadline"  # behind everything
    off, off_load = controller(FakeClock(), admission=[], max_drain_ms=2000)
    off_load.rate.seed(tokens=10_000, seconds=1.0)
    assert off.in_time(100, backlog, INTERACTIVE, seconds_left=0.01) is None


def test_buckets_budget_the_longest_wait_not_the_average():
    """A request that just missed its bucket's turn waits about twice the drain time."""
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=10_000, seconds=1.0)
    assert admission.admit(1000, queued(3500), INTERACTIVE) is None  # drains in 0.45 s, waits up to 0.9 s
    assert admission.admit(1000, queued(5000), INTERACTIVE) is not None  # drains in 0.6 s, may wait 1.2 s


def test_pushback_is_the_backlog_drain_time_jittered():
    """Not just the excess: clients told to come back in milliseconds all come back at once."""
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000, batching="naive")
    load.rate.seed(tokens=10_000, seconds=1.0)
    rejections = [admission.admit(1000, queued(9500), INTERACTIVE) for _ in range(200)]
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
        load.add_latency(0.2, INTERACTIVE)
    assert load.shed_fraction() == 0.0
    load.add_latency(0.2, INTERACTIVE)
    clock.now += 1
    expected = (0.2 - 0.08) / (0.3 - 0.08)  # linear from the recovery floor (80% of soft) to hard
    assert load.shed_fraction() == pytest.approx(expected)
    load.rate.seed(tokens=100, seconds=1.0)
    outcomes = [
        admission.prescreen(10, queued(10), INTERACTIVE) for _ in range(2000)
    ]  # a rejection would have taken 0.2 s
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
        load.add_latency(0.5, INTERACTIVE)
    assert load.shed_fraction() == 1.0
    assert admission.admit(10, queued(1000), INTERACTIVE) is None  # the latency draw happens once, before tokenizing
    rejection = admission.prescreen(10, queued(1000), INTERACTIVE)
    assert rejection is not None and rejection.reason == "latency_hard"
    assert rejection.retry_after_ms >= 10
    assert (
        admission.prescreen(10, queued(0), INTERACTIVE) is None
    )  # waits at most 20 ms, under the 80 ms recovery floor


def test_shedding_has_hysteresis_and_recovers_as_the_window_slides():
    clock = FakeClock()
    _, load = controller(clock, admission=["latency"], p95_soft_ms=100, p95_hard_ms=300, latency_window_s=5)
    for _ in range(20):
        load.add_latency(0.15, INTERACTIVE)
    assert load.shed_fraction() > 0 and load.shedding
    clock.now += 6  # the slow samples leave the window
    for _ in range(20):
        load.add_latency(0.09, INTERACTIVE)  # under soft, but above 80% of it: still shedding, a little
    clock.now += 0.1
    assert 0 < load.shed_fraction() < 0.1 and load.shedding
    clock.now += 6
    for _ in range(20):
        load.add_latency(0.05, INTERACTIVE)
    clock.now += 0.1
    assert load.shed_fraction() == 0.0 and not load.shedding


def test_rejections_count_in_the_shedding_window_at_the_wait_they_were_spared():
    """The drain time of the work ahead of them, not their own size: the P95 shedding acts on
    recovers as the backlog drains, and it follows what the queue holds."""
    clock = FakeClock()
    admission, load = controller(clock, admission=["throughput", "latency"], max_drain_ms=1000, p95_soft_ms=500)
    load.rate.seed(tokens=1000, seconds=1.0)
    for _ in range(10):
        assert admission.admit(100, queued(800), INTERACTIVE) is not None  # would have waited 0.8 s
    clock.now += 1
    assert load.pressure.p95() == pytest.approx(0.8)
    assert load.shed_fraction() > 0  # the rejections alone push it over the soft limit
    assert load.p95_seconds() == 0.0  # the exported P95 counts served requests alone
    clock.now += 11  # the window slides past them
    for _ in range(10):
        assert admission.admit(200, queued(350), INTERACTIVE) is not None  # the backlog drained: 0.35 s
    clock.now += 1
    assert load.pressure.p95() == pytest.approx(0.35)
    assert load.shed_fraction() == 0.0  # under the recovery floor (80% of the soft limit): off


def test_refusals_cannot_drive_the_p95():
    """However large the refused requests and however many, what they add to the shedding window is
    at most the drain budget, and the exported P95 (the autoscaler's, /health's) does not see them."""
    clock = FakeClock()
    admission, load = controller(
        clock, admission=["throughput", "latency"], max_drain_ms=2000, p95_soft_ms=1500, p95_hard_ms=3000
    )
    load.rate.seed(tokens=1000, seconds=1.0)
    for _ in range(20):
        load.add_latency(0.1, INTERACTIVE)  # what the served queries take
    for _ in range(1000):
        assert admission.admit(262_144, Backlog(batch=4000, in_flight=4000), BATCH) is not None
        assert admission.prescreen(2000, queued(4000), INTERACTIVE) is not None  # 4 s ahead: spared at most 2 s
    clock.now += 1
    assert load.p95_seconds() == pytest.approx(0.1)
    assert load.pressure.p95() == pytest.approx(2.0)  # the budget, under the 3 s hard limit
    assert load.shed_fraction() < 1.0


def test_no_strategies_still_bounds_the_queue():
    admission, load = controller(FakeClock(), admission="", max_queued_tokens=100)
    load.rate.seed(tokens=1, seconds=100.0)
    assert admission.admit(50, queued(0), INTERACTIVE) is None
    rejection = admission.admit(50, queued(70), INTERACTIVE)  # over the cap and its reserve (112)
    assert rejection is not None
    assert rejection.reason == "queue_full"


def test_screening_refuses_overload_before_the_exact_cost_is_known():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=1000, seconds=1.0)
    assert admission.prescreen(16, queued(400), INTERACTIVE) is None  # a lower bound that still fits
    assert admission.admit(256, queued(400), INTERACTIVE) is not None  # the exact cost does not
    rejection = admission.prescreen(16, queued(500), INTERACTIVE)
    assert rejection is not None
    assert rejection.reason == "drain_time"


def test_p95_is_recomputed_at_most_every_cache_period_however_many_samples_arrive():
    """Under overload every request adds a sample; recomputing per request cost more than serving it."""
    clock = FakeClock()
    _, load = controller(clock, admission=["latency"])
    for _ in range(MIN_LATENCY_SAMPLES):
        load.add_latency(0.1, INTERACTIVE)
    assert load.p95_seconds() == pytest.approx(0.1)
    for _ in range(100):
        load.add_latency(5.0, INTERACTIVE)
    assert load.p95_seconds() == pytest.approx(0.1)  # cached
    clock.now += P95_CACHE_S
    assert load.p95_seconds() == pytest.approx(5.0)


def test_the_p95_is_the_linear_percentile_of_the_samples_still_in_the_window():
    """What ``np.percentile`` gives over the window's samples, interpolated between ranks, while
    samples leave the window and new ones arrive."""
    clock, rng = FakeClock(), random.Random(3)
    window = LatencyWindow(window_s=2.0, clock=clock)
    added: list[tuple[float, float]] = []
    for step in range(60):
        for _ in range(rng.randint(0, 40)):
            seconds = rng.expovariate(10)
            window.add(seconds)
            added.append((clock.now, seconds))
        clock.now += 0.1
        recent = [seconds for at, seconds in added if at >= clock.now - 2.0]
        expected = float(np.percentile(recent, 95)) if len(recent) >= MIN_LATENCY_SAMPLES else None
        assert window.p95() == pytest.approx(expected, rel=1e-12), step


def test_the_window_holds_the_newest_samples_up_to_its_bound():
    clock = FakeClock()
    window = LatencyWindow(window_s=60.0, clock=clock)
    for _ in range(MAX_LATENCY_SAMPLES // 10):
        window.add(9.0)  # the oldest: overwritten by what follows
    for i in range(MAX_LATENCY_SAMPLES):
        window.add(i / MAX_LATENCY_SAMPLES)
    assert window.p95() == pytest.approx(0.95 * (MAX_LATENCY_SAMPLES - 1) / MAX_LATENCY_SAMPLES)


# --- priority classes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backlog", "priority", "admitted"),
    [
        # 10k tokens/s, a 1 s budget bounding twice the drain time: 5,000 tokens may be ahead.
        (Backlog(interactive=1000, batch=30_000, in_flight=2000), INTERACTIVE, True),  # batch work waits behind it
        (Backlog(interactive=1000, batch=30_000, in_flight=2000), BATCH, False),  # everything is ahead of it
        (Backlog(interactive=3000, in_flight=2000, in_flight_interactive=2000), INTERACTIVE, False),  # queries ahead
        (Backlog(interactive=3000, in_flight=2000), INTERACTIVE, True),  # an ingest's batch in the worker: never
        (Backlog(batch=3000, in_flight=1000), BATCH, True),
    ],
)
def test_each_class_is_admitted_against_the_work_it_waits_behind(backlog: Backlog, priority: Priority, admitted: bool):
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=10_000, seconds=1.0)
    assert (admission.admit(500, backlog, priority) is None) is admitted
    assert (admission.prescreen(500, backlog, priority) is None) is admitted  # the pre-screen agrees


def test_under_pressure_batch_work_is_refused_first_with_its_own_pushback():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=10_000, seconds=1.0)
    backlog = Backlog(interactive=500, batch=8000, in_flight=1000)
    refused = [admission.admit(500, backlog, BATCH) for _ in range(100)]
    assert all(r is not None and r.reason == "drain_time" for r in refused)
    pushbacks = [r.retry_after_ms for r in refused if r is not None]
    assert min(pushbacks) >= 500 and max(pushbacks) <= 1500  # the whole backlog's 1.0 s, +-50%
    assert admission.admit(500, backlog, INTERACTIVE) is None  # 0.2 s of work ahead of it
    short = admission.admit(500, Backlog(interactive=4600, batch=8000, in_flight=1000), INTERACTIVE)
    assert short is not None and short.retry_after_ms <= 765  # its own 0.51 s, not the batch backlog's


def test_an_interactive_request_displaces_batch_work_not_started_before_the_queue_cap_refuses_it():
    admission, _ = controller(FakeClock(), admission="", max_queued_tokens=1000)
    full = Backlog(interactive=100, batch=800, in_flight=100, displaceable=300)
    assert reason(admission.admit(200, full, BATCH)) == "queue_full"
    assert admission.admit(200, full, INTERACTIVE) is None
    assert admission.room_to_make(200, full, INTERACTIVE) == 200  # of the 300 it may take
    assert admission.room_to_make(200, full, BATCH) == 0
    assert admission.room_to_make(50, Backlog(interactive=100), INTERACTIVE) == 0  # it fits as is
    started = Backlog(interactive=100, batch=800, in_flight=100, displaceable=100)
    assert admission.admit(200, started, INTERACTIVE) is None  # within the cap's reserve for interactive work
    assert reason(admission.admit(400, started, INTERACTIVE)) == "queue_full"  # batch work that started stays
    displaced = admission.displaced(300, full.without_batch(300))
    assert displaced.reason == "displaced" and displaced.retry_after_ms >= 10


def shedding(clock: FakeClock, **settings) -> tuple[AdmissionController, MeasuredLoad]:
    """Interactive P95 at 0.2 s against a soft limit of 0.1 s: a shed fraction of about a half."""
    admission, load = controller(clock, admission=["latency"], p95_soft_ms=100, p95_hard_ms=300, **settings)
    load.rate.seed(tokens=100, seconds=1.0)
    for _ in range(20):
        load.add_latency(0.2, INTERACTIVE)
    clock.now += 1
    return admission, load


def test_while_shedding_batch_work_goes_first_and_interactive_work_only_once_none_is_there():
    admission, load = shedding(FakeClock())
    assert 0 < load.shed_fraction() < 1
    batch = [admission.prescreen(10, Backlog(batch=10), BATCH) for _ in range(200)]
    assert all(r is not None for r in batch)  # every batch request that would queue
    waiting = Backlog(interactive=10, batch=500, displaceable=500)
    assert all(admission.prescreen(10, waiting, INTERACTIVE) is None for _ in range(200))
    started = Backlog(interactive=10, batch=500, in_flight=64)  # an ingest running: it is what queries wait on
    assert all(admission.prescreen(10, started, INTERACTIVE) is None for _ in range(200))
    alone = [admission.prescreen(10, queued(10), INTERACTIVE) for _ in range(400)]
    assert 0.3 < sum(r is not None for r in alone) / len(alone) < 0.7  # by the fraction
    assert admission.prescreen(1, Backlog(), BATCH) is None  # work-conserving: it would not queue


def test_batch_latency_has_a_window_of_its_own_and_sheds_nothing():
    clock = FakeClock()
    admission, load = controller(clock, admission=["latency"], p95_soft_ms=100, p95_hard_ms=300)
    for _ in range(20):
        load.add_latency(5.0, BATCH)  # an ingest's calls take seconds, by design
        load.add_latency(0.02, INTERACTIVE)
    clock.now += 1
    assert load.p95_seconds(BATCH) == pytest.approx(5.0)
    assert load.p95_seconds() == pytest.approx(0.02)
    assert load.shed_fraction() == 0.0
    load.rate.seed(tokens=100, seconds=1.0)
    admission.admit(10_000_000, queued(0), BATCH)  # a refusal enters its class's window
    clock.now += 1
    assert load.p95_seconds() == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("backlog", "expected"),
    [
        (Backlog(), 0.0),
        (Backlog(interactive=500, batch=500, in_flight=250), 1.0),  # 2 x 0.25 s: the whole 0.5 s budget
        (Backlog(batch=500), 0.4),  # 2 x 0.1 s of the budget
        (Backlog(batch=100_000), 1.0),  # capped
    ],
)
def test_saturation_is_the_share_of_the_admission_budget_the_backlog_fills(backlog: Backlog, expected: float):
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=500, max_queued_tokens=50_000)
    load.rate.seed(tokens=5000, seconds=1.0)
    assert admission.saturation(backlog) == pytest.approx(expected)
    bounded, _ = controller(FakeClock(), admission="", max_queued_tokens=4000)
    assert bounded.saturation(Backlog(interactive=1000, batch=1000)) == pytest.approx(0.5)  # the cap alone


def test_a_request_with_nothing_ahead_of_it_is_admitted_however_long_it_takes():
    """Refusing it would idle the worker; and after a spell of one-text batches, whose rate is low,
    an ingest call larger than the budget at that rate would be refused for ever."""
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=1000, seconds=1.0)  # 500 tokens fit the budget
    assert admission.admit(5000, Backlog(), BATCH) is None
    assert admission.admit(5000, Backlog(batch=2000), INTERACTIVE) is None  # batch work is not ahead of it
    assert reason(admission.admit(5000, Backlog(in_flight=16), BATCH)) == "drain_time"
    assert reason(admission.prescreen(5000, Backlog(interactive=16), INTERACTIVE)) == "drain_time"


# --- no single request shuts out queries ---------------------------------------------------------


def test_an_interactive_request_too_large_for_its_share_is_served_as_batch_work():
    """At 10k tokens/s and a 1 s budget (twice the drain time with buckets), the interactive class
    holds 5,000 tokens; one request may hold half of it."""
    admission, load = controller(FakeClock(), max_drain_ms=1000)
    assert admission.class_of(1_000_000, INTERACTIVE) is INTERACTIVE  # no rate yet: nothing to weigh
    load.rate.seed(tokens=10_000, seconds=1.0)
    assert admission.class_of(2500, INTERACTIVE) is INTERACTIVE
    assert admission.class_of(2501, INTERACTIVE) is BATCH
    assert admission.class_of(16, BATCH) is BATCH  # batch work stays batch work
    # The largest interactive request still leaves room for a query behind it.
    assert admission.admit(2500, Backlog(), INTERACTIVE) is None
    assert admission.admit(256, queued(2500), INTERACTIVE) is None


def test_a_request_too_large_for_the_budget_waits_only_for_batch_work():
    """Its own wait is over the budget whatever is ahead: it is admitted when no batch work is queued
    or in the worker, whatever queries come and go (they would keep it out for ever)."""
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=1000)
    load.rate.seed(tokens=10_000, seconds=1.0)
    ingest = 200_000  # 20 s at this rate
    assert admission.admit(ingest, Backlog(), BATCH) is None
    assert admission.admit(ingest, Backlog(interactive=300, in_flight=64, in_flight_interactive=64), BATCH) is None
    assert reason(admission.admit(ingest, Backlog(batch=16), BATCH)) == "drain_time"
    assert reason(admission.admit(ingest, Backlog(in_flight=2048), BATCH)) == "drain_time"  # an ingest's batch
    assert reason(admission.prescreen(ingest, Backlog(batch=16), BATCH)) == "drain_time"


@pytest.mark.parametrize("rate", [200.0, 1850.0, 10_000.0])
def test_an_ingest_never_shuts_queries_out_at_any_rate(rate: float):
    """The rate measured from completed batches (a fake clock), an ingest of the queue cap's size
    queued with one of its batches in the worker: a query waits for that batch at most, and
    refusing it would not shorten it, so no query is refused, however slow the batches."""
    clock = FakeClock()
    admission, load = controller(clock, max_drain_ms=2000)
    batch_tokens = 2048
    for _ in range(20):  # batches complete at the rate
        clock.now += batch_tokens / rate
        load.rate.record(batch_tokens, batch_tokens / rate)
    assert load.tokens_per_second == pytest.approx(rate)
    ingest = Backlog(batch=262_144 - batch_tokens, in_flight=batch_tokens, displaceable=0)
    queries = []
    for _ in range(12):  # queries of 16 tokens, one by one, each answered before the next
        queries.append(admission.prescreen(16, ingest, INTERACTIVE) or admission.admit(16, ingest, INTERACTIVE))
        clock.now += 0.5
    assert queries == [None] * 12
    assert admission.class_of(16, INTERACTIVE) is INTERACTIVE  # and served as queries


def test_interactive_work_may_use_a_reserve_over_the_queue_cap():
    """Batch work that has started cannot be displaced: an ingest of the cap's size would otherwise
    refuse every query until its first batch completes. Batch work gets no reserve."""
    admission, _ = controller(FakeClock(), admission="", max_queued_tokens=8000)
    started = Backlog(batch=6000, in_flight=2000)  # the cap's size, all of it started
    assert admission.admit(16, started, INTERACTIVE) is None
    assert reason(admission.admit(16, started, BATCH)) == "queue_full"
    reserve = int(8000 * INTERACTIVE_RESERVE)
    assert admission.admit(reserve, started, INTERACTIVE) is None
    assert reason(admission.admit(reserve + 1, started, INTERACTIVE)) == "queue_full"


@pytest.mark.parametrize(
    ("queued", "rate", "latest", "lapsing_tokens"),
    [
        (5800, 100.0, 106.0, 5200),  # 58 s of work expiring in 6 s: 6 s of it can run
        (500, 100.0, 106.0, 0),  # it can all run in time
        (5800, 100.0, 99.0, 5800),  # past its deadline: none of it runs
        (5800, 0.0, 106.0, 0),  # no rate yet: nothing is known to lapse
        (5800, 100.0, float("-inf"), 0),  # no open job
    ],
)
def test_queued_work_lapses_by_what_the_worker_can_reach_before_its_deadline(
    queued: int, rate: float, latest: float, lapsing_tokens: int
):
    assert lapsing(queued, rate, latest, now=100.0) == lapsing_tokens


def test_lapsing_work_is_not_waited_behind_but_is_held():
    admission, load = controller(FakeClock(), admission=["throughput"], max_drain_ms=2000, max_queued_tokens=6000)
    load.rate.seed(tokens=100, seconds=1.0)
    backlog = Backlog(interactive=5800, interactive_lapsing=5750)  # 0.5 s of it can still run
    assert backlog.ahead(INTERACTIVE) == 50 and backlog.ahead(BATCH) == 50
    assert admission.admit(16, backlog, INTERACTIVE) is None  # 2 x 66 / 100 = 1.32 s
    assert reason(admission.admit(16, Backlog(interactive=5800), INTERACTIVE)) == "drain_time"  # 116 s
    assert reason(admission.admit(1000, backlog, INTERACTIVE)) == "queue_full"  # the cap (and reserve) counts it all


def test_the_rate_weighs_each_batch_by_its_size():
    """One-text queries at five a second run in 16-token batches, mostly the batch's fixed work:
    counted like full batches they took the rate to a tenth, and a backlog of a few queries was
    refused. Weighed by their size, a minute of them barely moves it, and batches of the sizes a
    load really runs bring it to what the worker does."""
    load = MeasuredLoad(Settings(), clock=FakeClock(), batch_tokens=2048)
    load.rate.seed(tokens=4000, seconds=1.0)  # warmup, full batches
    for _ in range(300):
        load.rate.record(16, 0.04)  # 400 tokens/s
    assert load.tokens_per_second > 3000
    load.rate.seed(tokens=1600, seconds=1.0)  # a pessimistic warmup, on a busy node
    for _ in range(100):
        load.rate.record(512, 0.128)  # quarter batches at 4,000 tokens/s
    assert load.tokens_per_second == pytest.approx(4000, rel=0.05)


@pytest.mark.parametrize("priority", [INTERACTIVE, BATCH])
def test_the_budget_info_tells_a_client_is_refused_by_neither_rule_even_while_shedding(priority: Priority):
    """gRPC Info's admission_budget_tokens (issue 59): work within it, queued and arriving, is admitted
    by the drain rule and never shed, whatever the P95; past it the rules may refuse."""
    clock = FakeClock()
    admission, load = controller(clock)  # both rules at their defaults: a 2 s budget, a 1.5 s soft P95
    load.rate.seed(tokens=10_000, seconds=1.0)
    for _ in range(50):
        load.add_latency(5.0, INTERACTIVE)  # past the hard limit: shedding all it may
    clock.now += 1
    assert load.shed_fraction() == 1.0
    budget = admission.budget_tokens()
    assert budget == 6_000  # 10,000 tokens/s x the recovery floor (1.2 s, under the 2 s budget) / 2 (buckets)
    for total in (100, budget // 2, budget - 1):
        for request in (1, total // 3, total):
            backlog = (
                Backlog(interactive=total - request) if priority is INTERACTIVE else Backlog(batch=total - request)
            )
            assert admission.prescreen(request, backlog, priority) is None
            assert admission.admit(request, backlog, priority) is None
    over = Backlog(interactive=budget) if priority is INTERACTIVE else Backlog(batch=budget)
    assert reason(admission.prescreen(100, over, priority)) == "latency_hard"


def test_the_budget_follows_the_rules_that_are_on():
    clock = FakeClock()
    for strategies, expected in ((["throughput"], 10_000), (["latency"], 6_000), ([], 262_144)):
        admission, load = controller(clock, admission=strategies)
        load.rate.seed(tokens=10_000, seconds=1.0)
        assert admission.budget_tokens() == expected, strategies
    admission, _ = controller(clock, max_queued_tokens=5_000)
    assert admission.budget_tokens() == 5_000  # no rate yet: the queue cap
