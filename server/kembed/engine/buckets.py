"""Length buckets: every item goes to the smallest bucket that holds it, so short sequences are
never padded to long ones. Each bucket keeps one queue per priority class. Pure and synchronous;
the batcher decides when a bucket drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kembed.engine.work import Chunk, Job
from kembed.inputs import Sequences
from kembed.priority import Priority
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


_FIRST = {first: (first, *(p for p in Priority if p is not first)) for first in Priority}  # take orders


class _ClassQueue:
    """One class's queued chunks per bucket, and the jobs of it none of whose items has started."""

    def __init__(self, buckets: int) -> None:
        self.chunks: list[deque[Chunk]] = [deque() for _ in range(buckets)]
        self.items = [0] * buckets
        self.tokens = 0
        self.waiting: dict[Job, None] = {}  # in admission order: the last is the youngest
        self.waiting_tokens = 0  # their queued tokens

    def drop(self, job: Job, tokens: int, stop_waiting: bool) -> None:
        """``tokens`` of the job's queued tokens leave the queue; with ``stop_waiting`` the job waits
        no more (one of its items was taken into a batch, or it was closed)."""
        if job in self.waiting:
            if stop_waiting:
                self.waiting_tokens -= job.queued_tokens
                del self.waiting[job]
            else:
                self.waiting_tokens -= tokens
        job.queued_tokens -= tokens
        self.tokens -= tokens


class BucketQueue:
    """The queued chunks of every bucket and class, oldest first, with the counts the batcher and
    admission decide on: items per bucket and class, queued tokens per class, and the requests
    waiting (none of their items started) per class, with their tokens.

    Chunks of closed jobs are skipped when taken; ``forget`` drops their tokens from the totals at
    once so admission sees the real backlog.
    """

    def __init__(self, bucket_lengths: Sequence[int]) -> None:
        self.bucket_lengths = list(bucket_lengths)
        self._classes = {priority: _ClassQueue(len(self.bucket_lengths)) for priority in Priority}

    @property
    def queued_tokens(self) -> int:
        return sum(c.tokens for c in self._classes.values())

    def tokens(self, priority: Priority) -> int:
        return self._classes[priority].tokens

    def waiting(self, priority: Priority) -> int:
        """Requests of the class none of whose items has started."""
        return len(self._classes[priority].waiting)

    def waiting_tokens(self, priority: Priority) -> int:
        return self._classes[priority].waiting_tokens

    def youngest_waiting(self, priority: Priority, tokens: int) -> list[Job]:
        """The most recently admitted waiting jobs of the class, as many as hold ``tokens``."""
        found, held = [], 0
        for job in reversed(self._classes[priority].waiting):
            if held >= tokens:
                break
            found.append(job)
            held += job.queued_tokens
        return found

    def add(self, bucket: int, chunk: Chunk) -> None:
        """Queue a chunk of a new job (a job's chunks are all added before any of them is taken)."""
        queue = self._classes[chunk.job.priority]
        queue.chunks[bucket].append(chunk)
        queue.items[bucket] += chunk.items
        tokens = chunk.items * self.bucket_lengths[bucket]
        chunk.job.queued_tokens += tokens
        queue.tokens += tokens
        queue.waiting.setdefault(chunk.job)
        queue.waiting_tokens += tokens

    def forget(self, job: Job) -> None:
        """A closed job's chunks no longer count towards the backlog."""
        self._classes[job.priority].drop(job, job.queued_tokens, stop_waiting=True)

    def items(self, bucket: int, priority: Priority | None = None) -> int:
        """Items queued in the bucket: of one class, or of every class."""
        if priority is None:
            return sum(c.items[bucket] for c in self._classes.values())
        return self._classes[priority].items[bucket]

    def oldest(self, bucket: int, priority: Priority | None = None) -> float | None:
        """When the bucket's oldest chunk (of one class, or of any) arrived; None if there is none."""
        if priority is not None:
            chunks = self._classes[priority].chunks[bucket]
            return chunks[0].enqueued if chunks else None
        arrivals = [t for p in Priority if (t := self.oldest(bucket, p)) is not None]
        return min(arrivals) if arrivals else None

    def take(
        self, bucket: int, n: int, now: float, first: Priority = Priority.INTERACTIVE
    ) -> tuple[list[Chunk], list[Job]]:
        """Up to ``n`` live items from the front of a bucket, those of class ``first`` first,
        splitting a chunk if needed; and the jobs found past their deadline meanwhile (nobody waits
        for them: close them)."""
        taken: list[Chunk] = []
        expired: list[Job] = []
        want = n
        for priority in _FIRST[first]:
            want = self._take(self._classes[priority], bucket, want, now, taken, expired)
        return taken, expired

    def _take(
        self, queue: _ClassQueue, bucket: int, want: int, now: float, taken: list[Chunk], expired: list[Job]
    ) -> int:
        chunks = queue.chunks[bucket]
        while want and chunks:
            chunk = chunks.popleft()
            queue.items[bucket] -= chunk.items
            live = not chunk.job.closed and chunk.job.deadline > now
            if live and chunk.items > want:
                chunk, rest = chunk.split(want)
                chunks.appendleft(rest)
                queue.items[bucket] += rest.items
            # A closed job that was forgotten has nothing left to subtract.
            queue.drop(chunk.job, min(chunk.items * self.bucket_lengths[bucket], chunk.job.queued_tokens), live)
            if live:
                taken.append(chunk)
                want -= chunk.items
            elif not chunk.job.closed and chunk.job not in expired:
                expired.append(chunk.job)
        return want

    def __len__(self) -> int:
        return sum(sum(c.items) for c in self._classes.values())
