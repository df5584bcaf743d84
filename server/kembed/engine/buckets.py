"""Length buckets: every item goes to the smallest bucket that holds it, so short sequences are
never padded to long ones. Pure and synchronous; the batcher decides when a bucket drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kembed.engine.work import Chunk, Job
from kembed.inputs import Sequences
from kembed.shapes import bucket_of


@dataclass(frozen=True)
class Routed:
    """One bucket's share of a run of sequences: which of them, their padded ids and lengths."""

    bucket: int  # index into the bucket lengths
    items: np.ndarray  # int64 [k]: indices into the routed sequences
    ids: np.ndarray  # int32 [k, bucket length]
    lengths: np.ndarray  # int32 [k]


def route(seqs: Sequences, bucket_lengths: Sequence[int], pad_id: int) -> list[Routed]:
    """Split sequences by bucket, each bucket's sequences padded into one matrix.

    Vectorised: one pass per bucket in use, none per item. Every length must fit the last bucket.
    """
    lengths = seqs.lengths
    which = bucket_of(lengths, bucket_lengths)
    offsets = seqs.offsets
    routed = []
    for bucket in np.unique(which):
        items = np.flatnonzero(which == bucket)
        width = bucket_lengths[int(bucket)]
        cols = np.arange(width)
        inside = cols[None, :] < lengths[items, None]
        # Positions past a sequence's end read a clamped index and are then replaced by padding.
        gather = np.minimum(offsets[items, None] + cols[None, :], len(seqs.ids) - 1)
        ids = np.where(inside, seqs.ids[gather], pad_id).astype(np.int32, copy=False)
        routed.append(Routed(int(bucket), items, ids, lengths[items]))
    return routed


class BucketQueue:
    """The queued chunks of every bucket, oldest first, with the counts the batcher decides on.

    Chunks of closed jobs are skipped when taken; ``forget`` drops their tokens from the total at
    once so admission sees the real backlog.
    """

    def __init__(self, bucket_lengths: Sequence[int]) -> None:
        self.bucket_lengths = list(bucket_lengths)
        self._chunks: list[deque[Chunk]] = [deque() for _ in self.bucket_lengths]
        self._items = [0] * len(self.bucket_lengths)
        self.queued_tokens = 0

    def add(self, bucket: int, chunk: Chunk) -> None:
        self._chunks[bucket].append(chunk)
        self._items[bucket] += chunk.items
        tokens = chunk.items * self.bucket_lengths[bucket]
        chunk.job.queued_tokens += tokens
        self.queued_tokens += tokens

    def forget(self, job: Job) -> None:
        """A closed job's chunks no longer count towards the backlog."""
        self.queued_tokens -= job.queued_tokens
        job.queued_tokens = 0

    def items(self, bucket: int) -> int:
        return self._items[bucket]

    def oldest(self, bucket: int) -> float | None:
        """When the bucket's oldest chunk arrived; None if empty."""
        chunks = self._chunks[bucket]
        return chunks[0].enqueued if chunks else None

    def take(self, bucket: int, n: int, now: float) -> tuple[list[Chunk], list[Job]]:
        """Up to ``n`` live items from the front of a bucket, splitting a chunk if needed; and the
        jobs found past their deadline meanwhile (nobody waits for them: close them)."""
        chunks, taken, expired, want = self._chunks[bucket], [], [], n
        while want and chunks:
            chunk = chunks.popleft()
            self._items[bucket] -= chunk.items
            live = not chunk.job.closed and chunk.job.deadline > now
            if live and chunk.items > want:
                chunk, rest = chunk.split(want)
                chunks.appendleft(rest)
                self._items[bucket] += rest.items
            # A closed job that was forgotten has nothing left to subtract.
            tokens = min(chunk.items * self.bucket_lengths[bucket], chunk.job.queued_tokens)
            chunk.job.queued_tokens -= tokens
            self.queued_tokens -= tokens
            if live:
                taken.append(chunk)
                want -= chunk.items
            elif not chunk.job.closed and chunk.job not in expired:
                expired.append(chunk.job)
        return taken, expired

    def __len__(self) -> int:
        return sum(self._items)
