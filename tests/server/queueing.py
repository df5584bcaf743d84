"""Test helpers: a request's sequences as queued chunks, the way the engine's intake cuts them, and
a WORK frame's parts, the way a front end sends them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kembed.engine.buckets import padded_lengths, route
from kembed.engine.intake import WORK_PARTS
from kembed.engine.work import Chunk, Job
from kembed.inputs import Sequences


def chunks(owner: Job, sequences: Sequences, bucket_lengths: Sequence[int], now: float) -> list[tuple[int, Chunk]]:
    """(bucket, chunk) pairs for one request's sequences, padded with id 0."""
    return [
        (part.bucket, Chunk(owner, part.items, part.ids, part.lengths, now))
        for part in route(sequences, bucket_lengths, 0)
    ]


def work_parts(
    requests: list[list[int]],
    tags: Sequence[int],
    bucket_lengths: Sequence[int],
    deadline: float = 1e9,
    cancels: Sequence[int] = (),
    latencies: Sequence[float] = (),
) -> list[np.ndarray]:
    """A WORK frame's parts: each request a list of sequence lengths (ids = position + 1)."""
    lengths = [n for request in requests for n in request]
    parts = [
        np.asarray(tags, "<u8"),
        np.full(len(tags), deadline, "<f8"),
        np.asarray([len(r) for r in requests], "<u4"),
        np.asarray([padded_lengths(np.asarray(r), bucket_lengths).sum() for r in requests], "<u8"),
        np.asarray(lengths, "<i4"),
        np.concatenate([np.arange(n, dtype="<i4") + 1 for n in lengths]) if lengths else np.empty(0, "<i4"),
        np.asarray(cancels, "<u8"),
        np.asarray(latencies, "<f8"),
    ]
    assert [part.dtype.str for part in parts] == list(WORK_PARTS)
    return parts
