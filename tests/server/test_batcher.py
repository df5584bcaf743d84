"""The batching policy with a fake clock, and the event-driven loop around it (with a fake clock
too: each step wakes the loop by an event and lets it run, so no step depends on how fast it runs)."""

import asyncio
import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest

from kembed.domain.inputs import Sequences
from kembed.engine.batcher import Batcher, BatchPolicy, BatchShapes, choose_batch, next_stale_time, pack
from kembed.engine.buckets import BucketQueue
from kembed.engine.units import Batch, Job
from kembed.policy.priority import Priority
from tests.server.queueing import chunks

LENGTHS = [16, 32, 64, 128]
MAX_WAIT = 0.02


INTERACTIVE, BATCH = Priority


def make_job(n: int, priority: Priority = INTERACTIVE) -> Job:
    return Job(link_id=1, tag=1, count=n, deadline=float("inf"), priority=priority)


def add(queue: BucketQueue, length: int, count: int, now: float, priority: Priority = INTERACTIVE) -> Job:
    ids = np.ones(length * count, np.int32)
    seqs = Sequences(ids, np.full(count, length, np.int32))
    job = make_job(count, priority)
    for bucket, chunk in chunks(job, seqs, queue.bucket_lengths, now):
        queue.add(bucket, chunk)
    return job


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def submit(batcher: Batcher, n: int, seqs: Sequences, now: float) -> None:
    batcher.submit(chunks(make_job(n), seqs, LENGTHS, now))


async def settle() -> None:
    """Let the batcher's loop handle what woke it and wait again: a few turns of the event loop."""
    for _ in range(10):
        await asyncio.sleep(0)


ONE_ITEM = Sequences(np.ones(5, np.int32), np.array([5], np.int32))


def make_batcher(
    policy: BatchPolicy, dispatch: Callable[[Batch], None], clock: Callable[[], float], expired: list[Job] | None = None
) -> Batcher:
    expire = (expired if expired is not None else []).append
    return Batcher(BucketQueue(LENGTHS), policy, dispatch, expire=expire, clock=clock)


SHAPES = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=True)
FIXED = BatchPolicy(SHAPES, max_wait=MAX_WAIT)
EAGER = BatchPolicy(BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False), max_wait=MAX_WAIT)
PACKED = dataclasses.replace(EAGER, packed=True, overhead_tokens=64)


def choose(queue, now, idle=False, policy=FIXED, starved_after=math.inf, batch_served_at=-math.inf):
    policy = dataclasses.replace(policy, starved_after=starved_after)
    return choose_batch(queue, policy=policy, now=now, idle=idle, batch_served_at=batch_served_at)


def test_shapes_are_fixed_powers_of_two_capped_by_tokens():
    assert SHAPES.sizes == (1, 2, 4, 8)
    assert [SHAPES.max_rows(n) for n in LENGTHS] == [8, 8, 8, 4]
    assert [SHAPES.rows_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert BatchShapes.build(48, 10_000, True).sizes == (1, 2, 4, 8, 16, 32, 48)
    assert BatchShapes.build(8, 512, fixed=False).rows_for(3) == 3
    assert (128, 4) in SHAPES.grid(LENGTHS) and (128, 8) not in SHAPES.grid(LENGTHS)


def test_nothing_queued_means_no_batch():
    assert choose(BucketQueue(LENGTHS), now=0.0, idle=True) is None


def test_busy_worker_waits_for_stale_or_full():
    queue = BucketQueue(LENGTHS)
    add(queue, 10, 3, now=0.0)
    assert choose(queue, now=0.01) is None
    assert next_stale_time(queue, MAX_WAIT) == pytest.approx(0.02)
    pick = choose(queue, now=0.02)
    assert (pick.bucket, pick.items, pick.reason) == (0, 3, "stale")


def test_oldest_stale_bucket_wins_so_none_starves():
    queue = BucketQueue(LENGTHS)
    add(queue, 100, 1, now=0.0)  # the long bucket, oldest
    add(queue, 10, 8, now=0.005)  # a full short bucket
    add(queue, 20, 2, now=0.01)
    pick = choose(queue, now=0.05)
    assert (pick.bucket, pick.reason) == (3, "stale")


def test_full_bucket_goes_before_it_is_stale():
    queue = BucketQueue(LENGTHS)
    add(queue, 10, 2, now=0.0)
    add(queue, 60, 9, now=0.001)
    pick = choose(queue, now=0.002)
    assert (pick.bucket, pick.items, pick.reason) == (2, 8, "full")


def test_idle_worker_takes_the_largest_bucket():
    queue = BucketQueue(LENGTHS)
    add(queue, 10, 3, now=0.0)  # 3 x 16 = 48 tokens
    add(queue, 30, 2, now=0.0)  # 2 x 32 = 64 tokens
    pick = choose(queue, now=0.001, idle=True)
    assert (pick.bucket, pick.items, pick.reason) == (1, 2, "idle")


def test_one_queue_takes_everything_in_arrival_order_when_idle():
    """The naive baseline: one bucket, eager and not packed."""
    queue = BucketQueue([128])
    add(queue, 10, 2, now=0.0)
    add(queue, 100, 1, now=0.0)
    assert choose(queue, now=0.0, policy=EAGER) is None  # a busy worker: not stale, not full
    assert choose(queue, now=0.0, idle=True, policy=EAGER).items == 3
    add(queue, 50, 2, now=0.0)
    pick = choose(queue, now=0.0, policy=EAGER)
    assert (pick.items, pick.reason) == (4, "full")  # 512 tokens / 128 = 4 rows at most


def test_interactive_work_leads_and_batch_work_fills_only_the_rows_its_shape_pads():
    queue = BucketQueue(LENGTHS)
    add(queue, 60, 9, now=0.0, priority=BATCH)  # a full bucket of batch work, and the oldest
    add(queue, 10, 5, now=0.0, priority=BATCH)
    add(queue, 10, 3, now=0.001)  # three queries
    pick = choose(queue, now=0.002, idle=True)
    assert (pick.bucket, pick.items) == (0, 4)  # padded to 4 rows: the fourth is a batch item, free
    pick = choose(queue, now=0.002, idle=True, policy=EAGER)
    assert (pick.items, pick.classes) == (3, (INTERACTIVE,))  # every row is computed: none added
    taken, _ = queue.take(0, 4, now=0.002)
    assert [c.job.priority for c in taken] == [INTERACTIVE, BATCH]


def test_a_busy_worker_forms_no_batch_work_while_interactive_work_waits_for_its_turn():
    queue = BucketQueue(LENGTHS)
    add(queue, 60, 9, now=0.0, priority=BATCH)  # full, and stale
    add(queue, 10, 1, now=0.03)
    assert choose(queue, now=0.04) is None  # the query is not stale yet; no batch goes before it
    assert next_stale_time(queue, MAX_WAIT) == pytest.approx(0.05)  # its turn, not the batch's
    assert choose(queue, now=0.05).bucket == 0
    queue.take(0, 1, now=0.05)
    assert choose(queue, now=0.05).bucket == 2  # then batch work, by the same rules


def test_batch_work_left_without_a_batch_for_the_floor_goes_next_whatever_interactive_work_waits():
    queue = BucketQueue(LENGTHS)
    add(queue, 60, 2, now=0.0, priority=BATCH)
    add(queue, 10, 9, now=0.5)  # a full bucket of queries, stale
    add(queue, 60, 1, now=0.9)  # and a query in the batch work's bucket
    assert choose(queue, now=0.99, idle=True, starved_after=1.0).bucket == 0
    assert choose(queue, now=1.5, idle=True, starved_after=1.0, batch_served_at=0.6).bucket == 0  # served lately
    pick = choose(queue, now=1.0, starved_after=1.0)  # the worker busy: it goes all the same
    assert (pick.bucket, pick.items, pick.reason, pick.classes) == (2, 3, "starved", (BATCH, INTERACTIVE))
    taken, _ = queue.take(pick.bucket, 2, now=1.0, classes=pick.classes)
    assert [c.job.priority for c in taken] == [BATCH]  # its own items first, not the query beside them


@pytest.mark.parametrize(("floor", "served"), [(1.0, [1.0, 2.0, 3.0]), (math.inf, [])])
def test_the_floor_bounds_how_long_interactive_traffic_starves_batch_work(floor: float, served: list[float]):
    """Queries arrive faster than the worker computes them, so interactive work alone would keep it
    busy for ever: with the floor, batch work gets a batch every ``floor`` seconds; without, never."""
    queue, now, batch_time = BucketQueue(LENGTHS), 0.0, 0.1
    for _ in range(3):
        add(queue, 60, 8, now=now, priority=BATCH)  # three full batches of ingest
    served_at, last = [], -math.inf
    while now < 3.5:
        add(queue, 10, 2, now=now)
        pick = choose(queue, now, idle=True, starved_after=floor, batch_served_at=last)
        taken, _ = queue.take(pick.bucket, pick.items, now, pick.classes)
        if any(chunk.job.priority is BATCH for chunk in taken):
            served_at.append(now)
            last = now
        now = round(now + batch_time, 6)
    assert served_at == served


@pytest.mark.parametrize(
    ("lengths", "lead", "max_rows", "max_tokens", "overhead", "taken"),
    [
        ([20, 27, 18], 0, 8, 512, 0, [20]),  # no overhead: batches of one are never padded
        ([20, 27, 18], 0, 8, 512, 64, [18, 20, 27]),  # an overhead worth padding 16 tokens to save
        ([20, 27, 18], 0, 2, 512, 64, [18, 20]),  # the row limit: 27 goes alone (18 alone would cost more)
        ([20, 27, 18], 0, 8, 50, 64, [18, 20]),  # the token budget: 2 x 27 is over
        ([10, 11, 12, 120, 121], 3, 8, 1024, 64, [120, 121]),  # padding 10 to 121 costs more than a batch
        ([10, 11, 12, 120, 121], 0, 8, 1024, 64, [10, 11, 12]),
        ([300, 5], 0, 8, 256, 64, [300]),  # a lone item longer than the budget still goes
    ],
)
def test_pack_splits_the_items_by_length_at_the_least_cost_and_sends_the_leads_run(
    lengths: list[int], lead: int, max_rows: int, max_tokens: int, overhead: float, taken: list[int]
):
    chosen = pack(np.array(lengths, np.int32), lead, max_rows, max_tokens, overhead)
    assert sorted(np.array(lengths)[chosen].tolist()) == taken and lead in chosen.tolist()


def test_a_packed_batch_takes_similar_lengths_from_both_sides_of_a_bucket_boundary():
    queue = BucketQueue(LENGTHS)
    for length, now in ((15, 0.0), (60, 0.001), (16, 0.002), (17, 0.003), (18, 0.004), (5, 0.005)):
        add(queue, length, 1, now=now, priority=BATCH)
    batches: list[Batch] = []
    batcher = Batcher(queue, PACKED, batches.append, expire=lambda job: None, clock=lambda: 0.05)
    batcher.dispatch_ready()
    [batch] = batches  # led by the oldest stale bucket, 16's; 60 would cost more padded than alone
    assert sorted(int(c.lengths[0]) for c in batch.chunks) == [5, 15, 16, 17, 18]  # buckets 16 and 32
    assert (batch.rows, batch.seq_len) == (5, 18) and batch.cost == 3 * 16 + 2 * 32
    assert batcher.backlog.total == 64 + batch.cost  # the 60 queued, the batch in flight
    assert (queue.items(0), queue.items(1), queue.items(2)) == (0, 0, 1)


def test_a_packed_batch_led_by_interactive_work_holds_only_interactive_items():
    queue = BucketQueue(LENGTHS)
    add(queue, 17, 3, now=0.0, priority=BATCH)
    add(queue, 16, 1, now=0.001)
    add(queue, 18, 1, now=0.002)
    batches: list[Batch] = []
    Batcher(queue, PACKED, batches.append, expire=lambda job: None, clock=lambda: 0.01).dispatch_ready()
    [batch] = batches
    assert [c.job.priority for c in batch.chunks] == [INTERACTIVE, INTERACTIVE] and batch.seq_len == 18
    assert queue.items(1, BATCH) == 3


def test_a_packed_batch_of_starved_batch_work_starts_from_its_oldest_item():
    queue = BucketQueue(LENGTHS)
    add(queue, 40, 1, now=0.0, priority=BATCH)  # the oldest batch item, in the 64 bucket
    add(queue, 30, 1, now=0.5, priority=BATCH)
    add(queue, 10, 8, now=0.9)  # queries enough to keep the worker busy
    batches: list[Batch] = []
    policy = dataclasses.replace(PACKED, starved_after=1.0)
    Batcher(queue, policy, batches.append, expire=lambda job: None, clock=lambda: 1.0).dispatch_ready()
    [batch] = batches
    assert sorted(int(c.lengths.max()) for c in batch.chunks) == [30, 40]  # its neighbour too, not the queries


async def test_loop_dispatches_on_events_and_bounds_in_flight():
    dispatched: list[Batch] = []
    clock = FakeClock()
    batcher = make_batcher(FIXED, dispatched.append, clock)
    task = asyncio.create_task(batcher.run())
    try:
        submit(batcher, 3, Sequences(np.ones(30, np.int32), np.full(3, 10, np.int32)), clock.now)
        await settle()
        assert len(dispatched) == 1  # idle worker: at once, no waiting for staleness
        first = dispatched[0]
        assert (first.rows, first.seq_len, first.items) == (4, 16, 3)  # padded to a fixed shape
        assert batcher.in_flight == 1 and batcher.backlog.in_flight == 3 * 16  # what it took from the backlog
        submit(batcher, 1, ONE_ITEM, clock.now)
        await settle()
        assert len(dispatched) == 1  # the worker is busy and nothing is stale yet
        clock.now += MAX_WAIT
        submit(batcher, 1, ONE_ITEM, clock.now)
        await settle()
        assert [b.items for b in dispatched] == [3, 2]  # stale: the second slot takes the bucket
        submit(batcher, 1, ONE_ITEM, clock.now)
        clock.now += MAX_WAIT
        await settle()
        assert len(dispatched) == 2  # stale, but both slots are taken
        batcher.batch_done(dispatched[0])
        await settle()
        assert [b.items for b in dispatched] == [3, 2, 1]
    finally:
        task.cancel()


@pytest.mark.parametrize(("lanes", "first", "then"), [(1, [3], [3, 3]), (2, [3, 2], [3, 2, 1])])
async def test_each_free_lane_takes_the_next_batch_at_once(lanes: int, first: list[int], then: list[int]):
    """Eager: a lane with nothing to do takes what is queued without waiting for staleness; a batch
    for every lane, and no more."""
    dispatched: list[Batch] = []
    clock = FakeClock()
    batcher = make_batcher(dataclasses.replace(PACKED, lanes=lanes), dispatched.append, clock)
    task = asyncio.create_task(batcher.run())
    try:
        submit(batcher, 3, Sequences(np.ones(30, np.int32), np.full(3, 10, np.int32)), clock.now)
        await settle()
        for _ in range(2):
            submit(batcher, 1, ONE_ITEM, clock.now)
        await settle()
        assert [b.items for b in dispatched] == first and batcher.in_flight == lanes
        submit(batcher, 1, ONE_ITEM, clock.now)
        await settle()
        assert [b.items for b in dispatched] == first  # every lane busy: nothing more in flight
        batcher.batch_done(dispatched[0])
        await settle()
        assert [b.items for b in dispatched] == then
    finally:
        task.cancel()


async def test_loop_does_not_poll_when_idle():
    wakeups = 0

    def clock() -> float:
        nonlocal wakeups
        wakeups += 1
        return asyncio.get_running_loop().time()

    batcher = make_batcher(FIXED, lambda batch: None, clock)
    task = asyncio.create_task(batcher.run())
    await asyncio.sleep(0.3)
    task.cancel()
    assert wakeups <= 2


@pytest.mark.parametrize("policy", [EAGER, PACKED])
async def test_eager_batches_are_trimmed_to_their_items(policy: BatchPolicy):
    dispatched: list[Batch] = []
    batcher = make_batcher(policy, dispatched.append, FakeClock())
    task = asyncio.create_task(batcher.run())
    try:
        lengths = np.array([20, 27, 18], np.int32)
        seqs = Sequences(np.ones(int(lengths.sum()), np.int32), lengths)
        submit(batcher, 3, seqs, 0.0)
        await settle()
        assert [(b.rows, b.seq_len) for b in dispatched] == [(3, 27)]  # not (4, 32)
    finally:
        task.cancel()


async def test_eager_mode_forms_the_next_batch_only_when_the_worker_is_free():
    """One batch in flight on CPU: what queues while it runs goes together, not in dribs and drabs."""
    dispatched: list[Batch] = []
    clock = FakeClock()
    batcher = make_batcher(PACKED, dispatched.append, clock)
    task = asyncio.create_task(batcher.run())
    try:
        submit(batcher, 1, ONE_ITEM, clock.now)
        await settle()
        assert len(dispatched) == 1
        for _ in range(3):
            submit(batcher, 1, ONE_ITEM, clock.now)
            clock.now += MAX_WAIT * 2
            await settle()
        assert len(dispatched) == 1  # stale, but the worker is busy
        batcher.batch_done(dispatched[0])
        await settle()
        assert [b.items for b in dispatched] == [1, 3]
    finally:
        task.cancel()


async def test_a_job_found_past_its_deadline_goes_to_whoever_closes_jobs():
    dispatched: list[Batch] = []
    expired: list[Job] = []
    clock = FakeClock()
    batcher = make_batcher(FIXED, dispatched.append, clock, expired)
    late = make_job(1)
    late.deadline = 1.0
    batcher.submit(chunks(late, ONE_ITEM, LENGTHS, clock.now))
    clock.now = 2.0
    task = asyncio.create_task(batcher.run())
    try:
        await settle()
        assert (dispatched, expired) == ([], [late])
    finally:
        task.cancel()


async def test_a_batch_of_ingest_longer_than_the_floor_leaves_the_next_turn_to_queries():
    """On a slow node a batch of ingest takes longer than the floor (the drain budget): counted from
    its start, batch work would be starved again the moment it finished, every time, and queries
    would wait for the whole ingest. Counted from its end, the queries waiting go next."""
    dispatched: list[Batch] = []
    clock = FakeClock()
    eager = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False)
    expired: list[Job] = []
    policy = BatchPolicy(eager, max_wait=MAX_WAIT, starved_after=2.0)
    batcher = Batcher(BucketQueue(LENGTHS), policy, dispatched.append, expire=expired.append, clock=clock)
    task = asyncio.create_task(batcher.run())
    try:
        ingest = Sequences(np.ones(5 * 40, np.int32), np.full(40, 5, np.int32))
        batcher.submit(chunks(make_job(40, BATCH), ingest, LENGTHS, clock.now))
        await settle()
        [first] = dispatched
        assert {chunk.job.priority for chunk in first.chunks} == {BATCH}
        submit(batcher, 1, ONE_ITEM, clock.now)  # a query, waiting behind it
        clock.now += 2.7  # the batch of ingest took longer than the floor
        batcher.batch_done(first)
        await settle()
        assert {chunk.job.priority for chunk in dispatched[1].chunks} == {INTERACTIVE}
    finally:
        task.cancel()
