"""Test helpers: a request's sequences as queued chunks, the way the engine's intake cuts them, and
a WORK message, the way a front end sends it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kembed.domain.inputs import Sequences
from kembed.engine.buckets import route
from kembed.engine.units import Chunk, Job
from kembed.ipc.protocol import Work, join_request_ids
from kembed.policy.priority import Priority
from kembed.policy.shapes import padded_lengths


def chunks(owner: Job, sequences: Sequences, bucket_lengths: Sequence[int], now: float) -> list[tuple[int, Chunk]]:
    """(bucket, chunk) pairs for one request's sequences, padded with id 0."""
    return [
        (part.bucket, Chunk(owner, part.items, part.ids, part.lengths, now))
        for part in route(sequences, bucket_lengths, 0)
    ]


def work(
    requests: list[list[int]],
    tags: Sequence[int],
    bucket_lengths: Sequence[int],
    deadline: float = 1e9,
    cancels: Sequence[int] = (),
    latencies: Sequence[float] = (),
    priorities: Sequence[Priority] = (),
) -> Work:
    """A WORK message: each request a list of sequence lengths (ids = position + 1), interactive
    unless ``priorities`` says otherwise; latency samples of interactive requests."""
    lengths = [n for request in requests for n in request]
    return Work(
        tags=np.asarray(tags, "<u8"),
        deadlines=np.full(len(tags), deadline, "<f8"),
        counts=np.asarray([len(r) for r in requests], "<u4"),
        costs=np.asarray([padded_lengths(np.asarray(r), bucket_lengths).sum() for r in requests], "<u8"),
        priorities=np.asarray(priorities or [Priority.INTERACTIVE] * len(tags), "u1"),
        lengths=np.asarray(lengths, "<i4"),
        ids=np.concatenate([np.arange(n, dtype="<i4") + 1 for n in lengths]) if lengths else np.empty(0, "<i4"),
        cancels=np.asarray(cancels, "<u8"),
        latencies=np.asarray(latencies, "<f8"),
        sample_priorities=np.zeros(len(latencies), "u1"),
        sample_refused=np.zeros(len(latencies), "u1"),
        request_ids=join_request_ids([""] * len(tags)),
    )
