"""The batching policy with a fake clock, and the event-driven loop around it."""

import asyncio

import numpy as np
import pytest

from kembed.batcher import Batcher, BatchShapes, choose_batch, next_stale_time
from kembed.buckets import BucketQueue, route
from kembed.inputs import Sequences
from kembed.work import Batch, Job

LENGTHS = [16, 32, 64, 128]
MAX_WAIT = 0.02


def make_job(loop: asyncio.AbstractEventLoop, n: int) -> Job:
    return Job("r", np.ones(n, np.int32), 0, 0.0, 99.0, loop.create_future(), np.zeros((n, 4), np.float32))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def add(queue: BucketQueue, loop, length: int, count: int, now: float) -> Job:
    ids = np.ones(length * count, np.int32)
    seqs = Sequences(ids, np.full(count, length, np.int32))
    job = make_job(loop, count)
    queue.add(job, route(seqs, queue.lengths, 0), now)
    return job


SHAPES = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=True)


def choose(queue, now, idle=False, naive=False):
    return choose_batch(queue, SHAPES, now, MAX_WAIT, idle, naive)


def test_shapes_are_fixed_powers_of_two_capped_by_tokens():
    assert SHAPES.sizes == (1, 2, 4, 8)
    assert [SHAPES.max_rows(n) for n in LENGTHS] == [8, 8, 8, 4]
    assert [SHAPES.rows_for(n, 16) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert BatchShapes.build(48, 10_000, True).sizes == (1, 2, 4, 8, 16, 32, 48)
    assert BatchShapes.build(8, 512, fixed=False).rows_for(3, 16) == 3
    assert (128, 4) in SHAPES.grid(LENGTHS) and (128, 8) not in SHAPES.grid(LENGTHS)


def test_nothing_queued_means_no_batch(loop):
    assert choose(BucketQueue(LENGTHS), now=0.0, idle=True) is None


def test_busy_worker_waits_for_stale_or_full(loop):
    queue = BucketQueue(LENGTHS)
    add(queue, loop, 10, 3, now=0.0)
    assert choose(queue, now=0.01) is None
    assert next_stale_time(queue, MAX_WAIT) == pytest.approx(0.02)
    pick = choose(queue, now=0.02)
    assert (pick.bucket, pick.rows, pick.reason) == (0, 3, "stale")


def test_oldest_stale_bucket_wins_so_none_starves(loop):
    queue = BucketQueue(LENGTHS)
    add(queue, loop, 100, 1, now=0.0)  # the long bucket, oldest
    add(queue, loop, 10, 8, now=0.005)  # a full short bucket
    add(queue, loop, 20, 2, now=0.01)
    pick = choose(queue, now=0.05)
    assert (pick.bucket, pick.reason) == (3, "stale")


def test_full_bucket_goes_before_it_is_stale(loop):
    queue = BucketQueue(LENGTHS)
    add(queue, loop, 10, 2, now=0.0)
    add(queue, loop, 60, 9, now=0.001)
    pick = choose(queue, now=0.002)
    assert (pick.bucket, pick.rows, pick.reason) == (2, 8, "full")


def test_idle_worker_takes_the_largest_bucket(loop):
    queue = BucketQueue(LENGTHS)
    add(queue, loop, 10, 3, now=0.0)  # 3 x 16 = 48 tokens
    add(queue, loop, 30, 2, now=0.0)  # 2 x 32 = 64 tokens
    pick = choose(queue, now=0.001, idle=True)
    assert (pick.bucket, pick.rows, pick.reason) == (1, 2, "idle")


def test_naive_takes_everything_in_arrival_order_when_idle(loop):
    queue = BucketQueue([128])
    add(queue, loop, 10, 2, now=0.0)
    add(queue, loop, 100, 1, now=0.0)
    assert choose(queue, now=1.0, naive=True) is None  # no staleness in the baseline
    assert choose(queue, now=1.0, idle=True, naive=True).rows == 3
    add(queue, loop, 50, 2, now=0.0)
    pick = choose(queue, now=1.0, naive=True)
    assert (pick.rows, pick.reason) == (4, "full")  # 512 tokens / 128 = 4 rows at most


async def test_loop_dispatches_on_events_and_bounds_in_flight():
    dispatched: list[Batch] = []
    queue = BucketQueue(LENGTHS)
    batcher = Batcher(queue, SHAPES, dispatched.append, max_wait=MAX_WAIT, naive=False)
    task = asyncio.create_task(batcher.run())
    loop = asyncio.get_running_loop()
    try:
        job = make_job(loop, 3)
        batcher.submit(job, route(Sequences(np.ones(30, np.int32), np.full(3, 10, np.int32)), LENGTHS, 0))
        await asyncio.sleep(0.01)
        assert len(dispatched) == 1  # idle worker: at once, no waiting for staleness
        first = dispatched[0]
        assert (first.rows, first.seq_len, first.real_rows) == (4, 16, 3)  # padded to a fixed shape
        assert batcher.in_flight == 1 and batcher.backlog_tokens == 64
        one_item = Sequences(np.ones(5, np.int32), np.array([5], np.int32))
        for _ in range(3):
            batcher.submit(make_job(loop, 1), route(one_item, LENGTHS, 0))
            await asyncio.sleep(MAX_WAIT * 2)
        assert len(dispatched) == 2  # the second slot filled once stale; the third waits
        batcher.batch_done(dispatched[0])
        await asyncio.sleep(0.01)
        assert len(dispatched) == 3
    finally:
        task.cancel()


async def test_loop_does_not_poll_when_idle():
    wakeups = 0

    def clock() -> float:
        nonlocal wakeups
        wakeups += 1
        return asyncio.get_running_loop().time()

    batcher = Batcher(BucketQueue(LENGTHS), SHAPES, lambda batch: None, max_wait=MAX_WAIT, naive=False, clock=clock)
    task = asyncio.create_task(batcher.run())
    await asyncio.sleep(0.3)
    task.cancel()
    assert wakeups <= 2


async def test_eager_batches_are_trimmed_to_their_items():
    dispatched: list[Batch] = []
    eager = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False)
    batcher = Batcher(BucketQueue(LENGTHS), eager, dispatched.append, max_wait=MAX_WAIT, naive=False)
    task = asyncio.create_task(batcher.run())
    try:
        lengths = np.array([20, 27, 18], np.int32)
        seqs = Sequences(np.ones(int(lengths.sum()), np.int32), lengths)
        batcher.submit(make_job(asyncio.get_running_loop(), 3), route(seqs, LENGTHS, 0))
        await asyncio.sleep(0.01)
        assert [(b.rows, b.seq_len) for b in dispatched] == [(3, 27)]  # not (4, 32)
    finally:
        task.cancel()


async def test_eager_mode_forms_the_next_batch_only_when_the_worker_is_free():
    """One batch in flight on CPU: what queues while it runs goes together, not in dribs and drabs."""
    dispatched: list[Batch] = []
    eager = BatchShapes.build(max_batch_size=8, max_tokens=512, fixed=False)
    batcher = Batcher(BucketQueue(LENGTHS), eager, dispatched.append, max_wait=MAX_WAIT, naive=False)
    task = asyncio.create_task(batcher.run())
    loop = asyncio.get_running_loop()
    one_item = Sequences(np.ones(5, np.int32), np.array([5], np.int32))
    try:
        batcher.submit(make_job(loop, 1), route(one_item, LENGTHS, 0))
        await asyncio.sleep(0.01)
        assert len(dispatched) == 1
        for _ in range(3):
            batcher.submit(make_job(loop, 1), route(one_item, LENGTHS, 0))
            await asyncio.sleep(MAX_WAIT * 2)
        assert len(dispatched) == 1  # stale, but the worker is busy
        batcher.batch_done(dispatched[0])
        await asyncio.sleep(0.01)
        assert [b.real_rows for b in dispatched] == [1, 3]
    finally:
        task.cancel()
