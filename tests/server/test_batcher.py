"""The batching policy with a fake clock, and the event-driven loop around it (with a fake clock
too: each step wakes the loop by an event and lets it run, so no step depends on how fast it runs)."""

import asyncio
import math
from collections.abc import Callable

import numpy as np
import pytest

from kembed.engine.batcher import Batcher, BatchShapes, choose_batch, next_stale_time
from kembed.engine.buckets import BucketQueue
from kembed.engine.work import Batch, Job
from kembed.inputs import Sequences
from kembed.priority import Priority
from tests.server.queueing import chunks

LENGTHS = [16, 32, 64, 128]
MAX_WAIT = 0.02


INTERACTIVE, BATCH = Priority


def make_job(n: int, priority: Priority = INTERACTIVE) -> Job:
    return Job(link=1, tag=1, count=n, deadline=float("inf"), priority=priority)


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
    shapes: BatchShapes, dispatch: Callable[[Batch], None], clock: Callable[[], float], expired: list[Job] | None = None
) -> Batcher:
    expire = (expired if expired is not None else []).append
    return Batcher(BucketQueue(LENGTHS), shapes, dispatch, expire=expire, max_wait=MAX_WAIT, naive=False, clock=clock)


SHAPES = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=True)


def choose(queue, now, idle=False, naive=False, shapes=SHAPES, starved_after=math.inf, batch_served_at=-math.inf):
    return choose_batch(queue, shapes, now, MAX_WAIT, idle, naive, starved_after, batch_served_at)


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


def test_naive_takes_everything_in_arrival_order_when_idle():
    queue = BucketQueue([128])
    add(queue, 10, 2, now=0.0)
    add(queue, 100, 1, now=0.0)
    assert choose(queue, now=1.0, naive=True) is None  # no staleness in the baseline
    assert choose(queue, now=1.0, idle=True, naive=True).items == 3
    add(queue, 50, 2, now=0.0)
    pick = choose(queue, now=1.0, naive=True)
    assert (pick.items, pick.reason) == (4, "full")  # 512 tokens / 128 = 4 rows at most


def test_interactive_work_leads_and_batch_work_fills_only_the_rows_its_shape_pads():
    queue = BucketQueue(LENGTHS)
    add(queue, 60, 9, now=0.0, priority=BATCH)  # a full bucket of batch work, and the oldest
    add(queue, 10, 5, now=0.0, priority=BATCH)
    add(queue, 10, 3, now=0.001)  # three queries
    pick = choose(queue, now=0.002, idle=True)
    assert (pick.bucket, pick.items) == (0, 4)  # padded to 4 rows: the fourth is a batch item, free
    eager = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False)
    assert choose(queue, now=0.002, idle=True, shapes=eager).items == 3  # every row is computed: none added
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
    assert (pick.bucket, pick.items, pick.reason, pick.first) == (2, 3, "starved", BATCH)
    taken, _ = queue.take(pick.bucket, 2, now=1.0, first=pick.first)
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
        taken, _ = queue.take(pick.bucket, pick.items, now, pick.first)
        if any(chunk.job.priority is BATCH for chunk in taken):
            served_at.append(now)
            last = now
        now = round(now + batch_time, 6)
    assert served_at == served


async def test_loop_dispatches_on_events_and_bounds_in_flight():
    dispatched: list[Batch] = []
    clock = FakeClock()
    batcher = make_batcher(SHAPES, dispatched.append, clock)
    task = asyncio.create_task(batcher.run())
    try:
        submit(batcher, 3, Sequences(np.ones(30, np.int32), np.full(3, 10, np.int32)), clock.now)
        await settle()
        assert len(dispatched) == 1  # idle worker: at once, no waiting for staleness
        first = dispatched[0]
        assert (first.rows, first.seq_len, first.items) == (4, 16, 3)  # padded to a fixed shape
        assert batcher.in_flight == 1 and batcher.backlog_tokens == 64
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


async def test_loop_does_not_poll_when_idle():
    wakeups = 0

    def clock() -> float:
        nonlocal wakeups
        wakeups += 1
        return asyncio.get_running_loop().time()

    batcher = make_batcher(SHAPES, lambda batch: None, clock)
    task = asyncio.create_task(batcher.run())
    await asyncio.sleep(0.3)
    task.cancel()
    assert wakeups <= 2


async def test_eager_batches_are_trimmed_to_their_items():
    dispatched: list[Batch] = []
    eager = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False)
    batcher = make_batcher(eager, dispatched.append, FakeClock())
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
    eager = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False)
    batcher = make_batcher(eager, dispatched.append, clock)
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
    batcher = make_batcher(SHAPES, dispatched.append, clock, expired)
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
    batcher = Batcher(BucketQueue(LENGTHS), eager, dispatched.append, expire=expired.append, max_wait=MAX_WAIT,
                      naive=False, starved_after=2.0, clock=clock)  # fmt: skip
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
