"""Test helpers: a request's sequences as queued chunks, the way the engine's intake cuts them."""

from __future__ import annotations

from collections.abc import Sequence

from kembed.engine.buckets import route
from kembed.engine.work import Chunk, Job
from kembed.inputs import Sequences


def chunks(owner: Job, sequences: Sequences, bucket_lengths: Sequence[int], now: float) -> list[tuple[int, Chunk]]:
    """(bucket, chunk) pairs for one request's sequences, padded with id 0."""
    return [
        (part.bucket, Chunk(owner, part.items, part.ids, part.lengths, now))
        for part in route(sequences, bucket_lengths, 0)
    ]
