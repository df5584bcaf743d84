"""Length buckets: every item goes to the smallest bucket that holds it, so short sequences are
never padded to long ones. Pure and synchronous; the batcher decides when a bucket drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kembed.inputs import Sequences
from kembed.work import Chunk, Job


def clip_buckets(lengths: Sequence[int], max_input_tokens: int) -> list[int]:
    """Bucket lengths below the model's limit, plus the limit itself as the last bucket."""
    return [length for length in lengths if length < max_input_tokens] + [max_input_tokens]


@dataclass(frozen=True)
class Routed:
    """One bucket's share of a request: which items, their padded ids and lengths."""

    bucket: int  # index into the bucket lengths
    rows: np.ndarray  # int64 [k]
    ids: np.ndarray  # int32 [k, bucket length]
    lengths: np.ndarray  # int32 [k]


def route(seqs: Sequences, bucket_lengths: Sequence[int], pad_id: int) -> list[Routed]:
    """Split a request's items by bucket, each bucket's items padded into one matrix.

    Vectorised: one pass per bucket in use, none per item. Every length must fit the last bucket.
    """
    lengths = seqs.lengths
    which = np.searchsorted(np.asarray(bucket_lengths), lengths, side="left")
    offsets = seqs.offsets
    routed = []
    for bucket in np.unique(which):
        rows = np.flatnonzero(which == bucket)
        width = bucket_lengths[int(bucket)]
        cols = np.arange(width)
        inside = cols[None, :] < lengths[rows, None]
        # Positions past a row's end read a clamped index and are then replaced by padding.
        gather = np.minimum(offsets[rows, None] + cols[None, :], len(seqs.ids) - 1)
        ids = np.where(inside, seqs.ids[gather], pad_id).astype(np.int32, copy=False)
        routed.append(Routed(int(bucket), rows, ids, lengths[rows]))
    return routed


def padded_tokens(routed: Iterable[Routed], bucket_lengths: Sequence[int]) -> int:
    """What a request costs once padded to its buckets: the unit admission control counts."""
    return sum(len(part.rows) * bucket_lengths[part.bucket] for part in routed)


class BucketQueue:
    """The queued chunks of every bucket, oldest first, with the counts the batcher decides on.

    Chunks of closed jobs are skipped when taken; ``forget`` drops their tokens from the total at
    once so admission sees the real backlog.
    """

    def __init__(self, bucket_lengths: Sequence[int]) -> None:
        self.lengths = list(bucket_lengths)
        self._chunks: list[deque[Chunk]] = [deque() for _ in self.lengths]
        self._rows = [0] * len(self.lengths)
        self.queued_tokens = 0

    def add(self, job: Job, routed: Iterable[Routed], now: float) -> None:
        for part in routed:
            self._chunks[part.bucket].append(Chunk(job, part.rows, part.ids, part.lengths, now))
            self._rows[part.bucket] += len(part.rows)
            tokens = len(part.rows) * self.lengths[part.bucket]
            job.queued_tokens += tokens
            self.queued_tokens += tokens

    def forget(self, job: Job) -> None:
        """A closed job's chunks no longer count towards the backlog."""
        self.queued_tokens -= job.queued_tokens
        job.queued_tokens = 0

    def rows(self, bucket: int) -> int:
        return self._rows[bucket]

    def oldest(self, bucket: int) -> float | None:
        """When the bucket's oldest chunk arrived; None if empty."""
        chunks = self._chunks[bucket]
        return chunks[0].enqueued if chunks else None

    def take(self, bucket: int, n: int) -> list[Chunk]:
        """Up to ``n`` live items from the front of a bucket, splitting a chunk if needed."""
        chunks, taken, want = self._chunks[bucket], [], n
        while want and chunks:
            chunk = chunks.popleft()
            self._rows[bucket] -= chunk.size
            if not chunk.job.closed and chunk.size > want:
                chunk, rest = chunk.split(want)
                chunks.appendleft(rest)
                self._rows[bucket] += rest.size
            # A closed job that was forgotten has nothing left to subtract.
            tokens = min(chunk.size * self.lengths[bucket], chunk.job.queued_tokens)
            chunk.job.queued_tokens -= tokens
            self.queued_tokens -= tokens
            if not chunk.job.closed:
                taken.append(chunk)
                want -= chunk.size
        return taken

    def __len__(self) -> int:
        return sum(self._rows)
