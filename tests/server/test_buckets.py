"""Routing items into length buckets and taking them out again."""

import asyncio

import numpy as np
import pytest

from kembed.buckets import BucketQueue, clip_buckets, padded_tokens, route
from kembed.inputs import Sequences
from kembed.work import Job

LENGTHS = [16, 32, 64]
PAD = 0


def seqs(*lengths: int) -> Sequences:
    """Sequence i holds ids 1000*(i+1) + position, so any mix-up shows."""
    parts = [np.arange(n, dtype=np.int32) + 1000 * (i + 1) for i, n in enumerate(lengths)]
    return Sequences(np.concatenate(parts), np.asarray(lengths, dtype=np.int32))


def job(n: int) -> Job:
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
    finally:
        loop.close()
    return Job("r", np.ones(n, dtype=np.int32), 0, 0.0, 10.0, future, np.zeros((n, 4), np.float32))


def test_clip_buckets_ends_at_the_model_limit():
    assert clip_buckets([16, 32, 64, 128, 256, 512], 256) == [16, 32, 64, 128, 256]
    assert clip_buckets([16, 32, 64, 128, 256, 512], 300) == [16, 32, 64, 128, 256, 300]
    assert clip_buckets([16, 32], 8) == [8]


def test_each_item_goes_to_the_smallest_bucket_that_fits():
    s = seqs(3, 16, 17, 64, 1, 40)
    routed = {part.bucket: part for part in route(s, LENGTHS, PAD)}
    assert routed[0].rows.tolist() == [0, 1, 4]
    assert routed[1].rows.tolist() == [2]
    assert routed[2].rows.tolist() == [3, 5]
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
    assert padded_tokens(parts, LENGTHS) == 16 + 32


def test_take_splits_a_chunk_and_keeps_accounting():
    queue = BucketQueue(LENGTHS)
    j = job(5)
    queue.add(j, route(seqs(2, 2, 2, 2, 2), LENGTHS, PAD), now=1.0)
    assert queue.queued_tokens == 5 * 16 == j.queued_tokens
    first = queue.take(0, 3)
    assert [c.rows.tolist() for c in first] == [[0, 1, 2]]
    assert queue.rows(0) == 2
    assert queue.queued_tokens == 2 * 16
    rest = queue.take(0, 10)
    assert [c.rows.tolist() for c in rest] == [[3, 4]]
    assert queue.queued_tokens == 0 == len(queue)


def test_forgotten_jobs_leave_the_backlog_at_once_and_are_skipped():
    queue = BucketQueue(LENGTHS)
    dead, alive = job(2), job(1)
    queue.add(dead, route(seqs(4, 4), LENGTHS, PAD), now=1.0)
    queue.add(alive, route(seqs(5), LENGTHS, PAD), now=2.0)
    dead.abandon()
    queue.forget(dead)
    assert queue.queued_tokens == 16
    taken = queue.take(0, 8)
    assert [c.job for c in taken] == [alive]
    assert queue.queued_tokens == 0


@pytest.mark.parametrize("n", [1, 7, 200])
def test_route_handles_many_items_without_mixing_them(n: int):
    rng = np.random.default_rng(n)
    lengths = rng.integers(1, 65, size=n)
    s = seqs(*lengths.tolist())
    rebuilt = {}
    for part in route(s, LENGTHS, PAD):
        for row, ids, length in zip(part.rows, part.ids, part.lengths, strict=True):
            rebuilt[int(row)] = ids[:length].tolist()
    offsets = s.offsets
    for i, length in enumerate(lengths):
        assert rebuilt[i] == s.ids[offsets[i] : offsets[i] + length].tolist()
