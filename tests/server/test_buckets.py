"""Routing items into length buckets and taking them out again."""

import numpy as np
import pytest

from kembed.domain.inputs import Sequences
from kembed.engine.buckets import BucketQueue, route
from kembed.engine.units import Job
from kembed.policy.priority import Priority
from kembed.policy.shapes import FEW_ITEMS, clip_buckets, padded_lengths, padded_tokens
from tests.server.queueing import chunks

LENGTHS = [16, 32, 64]
PAD = 0


def seqs(*lengths: int) -> Sequences:
    """Sequence i holds ids 1000*(i+1) + position, so any mix-up shows."""
    parts = [np.arange(n, dtype=np.int32) + 1000 * (i + 1) for i, n in enumerate(lengths)]
    return Sequences(np.concatenate(parts), np.asarray(lengths, dtype=np.int32))


INTERACTIVE, BATCH = Priority


def job(n: int, deadline: float = 10.0, priority: Priority = INTERACTIVE, tag: int = 1) -> Job:
    return Job(link_id=1, tag=tag, count=n, deadline=deadline, priority=priority)


def enqueue(queue: BucketQueue, owner: Job, sequences: Sequences, now: float) -> None:
    for bucket, chunk in chunks(owner, sequences, queue.bucket_lengths, now):
        queue.add(bucket, chunk)


def test_clip_buckets_ends_at_the_model_limit():
    assert clip_buckets([16, 32, 64, 128, 256, 512], 256) == [16, 32, 64, 128, 256]
    assert clip_buckets([16, 32, 64, 128, 256, 512], 300) == [16, 32, 64, 128, 256, 300]
    assert clip_buckets([16, 32], 8) == [8]


def test_each_item_goes_to_the_smallest_bucket_that_fits():
    s = seqs(3, 16, 17, 64, 1, 40)
    routed = {part.bucket: part for part in route(s, LENGTHS, PAD)}
    assert routed[0].items.tolist() == [0, 1, 4]
    assert routed[1].items.tolist() == [2]
    assert routed[2].items.tolist() == [3, 5]
    assert routed[2].ids.shape == (2, 64)
    assert routed[2].lengths.tolist() == [64, 40]


def test_routed_ids_are_the_items_ids_right_padded():
    s = seqs(3, 20)
    parts = route(s, LENGTHS, PAD)
    small, mid = parts
    assert small.ids[0, :3].tolist() == [1000, 1001, 1002]
    assert (small.ids[0, 3:] == PAD).all()
    assert mid.ids[0, :20].tolist() == list(range(2000, 2020))
    assert (mid.ids[0, 20:] == PAD).all()
    assert padded_lengths(s.lengths, LENGTHS).tolist() == [16, 32]


@pytest.mark.parametrize("count", [0, 1, FEW_ITEMS, FEW_ITEMS + 1, 100])
def test_a_requests_padded_cost_is_the_same_summed_in_python_or_numpy(count):
    # Every boundary: a bucket's length itself, one past it, and past the last bucket.
    lengths = np.resize(np.asarray([1, 15, 16, 17, 32, 33, 64, 65, 300], dtype=np.int32), count)
    assert padded_tokens(lengths, LENGTHS) == int(padded_lengths(lengths, LENGTHS).sum())


def test_take_splits_a_chunk_and_keeps_accounting():
    queue = BucketQueue(LENGTHS)
    j = job(5)
    enqueue(queue, j, seqs(2, 2, 2, 2, 2), now=1.0)
    assert queue.queued_tokens == 5 * 16 == j.queued_tokens
    first, _ = queue.take(0, 3, now=1.0)
    assert [c.slots.tolist() for c in first] == [[0, 1, 2]]
    assert queue.items(0) == 2
    assert queue.queued_tokens == 2 * 16
    rest, _ = queue.take(0, 10, now=1.0)
    assert [c.slots.tolist() for c in rest] == [[3, 4]]
    assert queue.queued_tokens == 0 == len(queue)


def test_forgotten_jobs_leave_the_backlog_at_once_and_are_skipped():
    queue = BucketQueue(LENGTHS)
    dead, alive = job(2), job(1)
    enqueue(queue, dead, seqs(4, 4), now=1.0)
    enqueue(queue, alive, seqs(5), now=2.0)
    dead.closed = True
    queue.forget(dead)
    assert queue.queued_tokens == 16
    taken, expired = queue.take(0, 8, now=2.0)
    assert [c.job for c in taken] == [alive] and expired == []  # the dead job was closed already
    assert queue.queued_tokens == 0


def test_jobs_past_their_deadline_are_reported_when_taken():
    queue = BucketQueue(LENGTHS)
    late, on_time = job(2, deadline=5.0), job(1, deadline=50.0)
    enqueue(queue, late, seqs(4, 4), now=1.0)
    enqueue(queue, on_time, seqs(4), now=2.0)
    taken, expired = queue.take(0, 8, now=6.0)
    assert [c.job for c in taken] == [on_time]
    assert expired == [late] and queue.queued_tokens == 0  # reported once, for whoever closes jobs


def test_a_bucket_gives_its_interactive_items_first_and_counts_each_class():
    queue = BucketQueue(LENGTHS)
    ingest, query = job(3, priority=BATCH, tag=1), job(1, tag=2)
    enqueue(queue, ingest, seqs(4, 4, 40), now=1.0)
    enqueue(queue, query, seqs(5), now=2.0)
    assert (queue.items(0), queue.items(0, INTERACTIVE), queue.items(0, BATCH)) == (3, 1, 2)
    assert (queue.oldest(0), queue.oldest(0, INTERACTIVE), queue.oldest(0, BATCH)) == (1.0, 2.0, 1.0)
    assert (queue.tokens(INTERACTIVE), queue.tokens(BATCH), queue.queued_tokens) == (16, 2 * 16 + 64, 112)
    taken, _ = queue.take(0, 2, now=2.0)
    assert [(c.job, c.items) for c in taken] == [(query, 1), (ingest, 1)]  # the query, then batch fills
    assert queue.tokens(BATCH) == 16 + 64


def test_requests_wait_until_one_of_their_items_is_taken_and_the_youngest_are_found_first():
    queue = BucketQueue(LENGTHS)
    old, young, started = job(1, priority=BATCH, tag=1), job(2, priority=BATCH, tag=2), job(1, priority=BATCH, tag=3)
    enqueue(queue, started, seqs(30), now=0.5)
    enqueue(queue, old, seqs(4), now=1.0)
    enqueue(queue, young, seqs(4, 40), now=2.0)
    queue.take(1, 1, now=2.0)  # the 32 bucket: ``started``'s only item, and nobody else's
    assert (queue.waiting(BATCH), queue.waiting_tokens(BATCH)) == (2, 16 + 16 + 64)
    assert queue.youngest_waiting(BATCH, 50) == [young]
    assert queue.youngest_waiting(BATCH, 81) == [young, old]
    queue.take(0, 1, now=2.0)  # ``old``'s item: it started
    assert (queue.waiting(BATCH), queue.waiting_tokens(BATCH)) == (1, 16 + 64)
    young.closed = True
    queue.forget(young)
    assert (queue.waiting(BATCH), queue.waiting_tokens(BATCH), queue.tokens(BATCH)) == (0, 0, 0)


def test_an_expired_item_of_a_waiting_request_leaves_its_waiting_tokens():
    queue = BucketQueue(LENGTHS)
    late = job(2, deadline=5.0, priority=BATCH)
    enqueue(queue, late, seqs(4, 40), now=1.0)
    _, expired = queue.take(0, 8, now=6.0)
    assert expired == [late] and queue.waiting_tokens(BATCH) == 64  # its 64-token item is still queued
    late.closed = True
    queue.forget(late)  # as whoever closes jobs does
    assert (queue.waiting(BATCH), queue.waiting_tokens(BATCH), queue.queued_tokens) == (0, 0, 0)


def test_front_finds_live_chunks_in_order_and_drops_the_dead():
    queue = BucketQueue(LENGTHS)
    late, query, ingest, next_door = (
        job(1, deadline=5.0, tag=1),
        job(2, tag=2),
        job(1, priority=BATCH, tag=3),
        job(1, tag=4),
    )
    enqueue(queue, late, seqs(4), now=1.0)
    enqueue(queue, query, seqs(5, 6), now=2.0)
    enqueue(queue, ingest, seqs(7), now=2.0)
    enqueue(queue, next_door, seqs(20), now=3.0)
    found, expired = queue.front([0, 1], (INTERACTIVE,), items=8, now=6.0)
    assert [(bucket, chunk.job) for bucket, chunk in found] == [(0, query), (1, next_door)]  # no batch work
    assert expired == [late] and queue.items(0) == 3  # the late item left; the rest is still queued
    assert queue.tokens(INTERACTIVE) == 2 * 16 + 32


def test_take_items_takes_some_of_a_chunk_and_leaves_the_rest_in_its_place():
    queue = BucketQueue(LENGTHS)
    first, second = job(3, priority=BATCH, tag=1), job(1, priority=BATCH, tag=2)
    enqueue(queue, first, seqs(3, 9, 5), now=1.0)
    enqueue(queue, second, seqs(4), now=2.0)
    [(bucket, chunk), _], _ = queue.front([0], (BATCH,), items=8, now=2.0)
    taken = queue.take_items(bucket, chunk, np.array([False, True, False]))
    assert (taken.slots.tolist(), taken.lengths.tolist(), taken.ids[0, :9].tolist()) == (
        [1],
        [9],
        list(range(2000, 2009)),
    )
    assert (queue.items(0), queue.tokens(BATCH), first.queued_tokens) == (3, 3 * 16, 2 * 16)
    assert (queue.waiting(BATCH), queue.waiting_tokens(BATCH)) == (1, 16)  # ``first`` started; ``second`` waits
    rest, _ = queue.take(0, 8, now=2.0)
    assert [(c.job, c.slots.tolist()) for c in rest] == [(first, [0, 2]), (second, [0])]  # in their places
    assert queue.queued_tokens == 0 == len(queue)


@pytest.mark.parametrize("n", [1, 7, 200])
def test_route_handles_many_items_without_mixing_them(n: int):
    rng = np.random.default_rng(n)
    lengths = rng.integers(1, 65, size=n)
    s = seqs(*lengths.tolist())
    rebuilt = {}
    for part in route(s, LENGTHS, PAD):
        for item, ids, length in zip(part.items, part.ids, part.lengths, strict=True):
            rebuilt[int(item)] = ids[:length].tolist()
    offsets = s.offsets
    for i, length in enumerate(lengths):
        assert rebuilt[i] == s.ids[offsets[i] : offsets[i] + length].tolist()
