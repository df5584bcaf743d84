"""Length buckets: every item goes to the smallest bucket that holds it, so short sequences are
never padded to long ones. Each bucket keeps one queue per priority class. Pure and synchronous;
the batcher decides when a bucket drains, and which of the items at its front (and at its
neighbours') go together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kembed.domain.inputs import Sequences
from kembed.engine.units import Chunk, Job
from kembed.policy.priority import Priority
from kembed.policy.shapes import bucket_of


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


EVERY_CLASS = tuple(Priority)  # interactive first


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
        self, bucket: int, n: int, now: float, classes: tuple[Priority, ...] = EVERY_CLASS
    ) -> tuple[list[Chunk], list[Job]]:
        """Up to ``n`` live items from the front of a bucket, of these classes in this order,
        splitting a chunk if needed; and the jobs found past their deadline meanwhile (nobody waits
        for them: close them)."""
        taken: list[Chunk] = []
        expired: list[Job] = []
        want = n
        for priority in classes:
            want = self._take(self._classes[priority], bucket, want, now, taken, expired)
        return taken, expired

    def front(
        self, buckets: Sequence[int], classes: tuple[Priority, ...], items: int, now: float
    ) -> tuple[list[tuple[int, Chunk]], list[Job]]:
        """The live chunks at the front of these buckets' queues of these classes, as many as hold
        ``items`` items in each, in the order asked (the first is the oldest of the first bucket's
        first class), each with its bucket; and the jobs found past their deadline meanwhile. Dead
        chunks found there leave the queue. Nothing live is taken: see :meth:`take_items`."""
        found: list[tuple[int, Chunk]] = []
        expired: list[Job] = []
        for bucket in buckets:
            for priority in classes:
                queue, held, index = self._classes[priority], 0, 0
                chunks = queue.chunks[bucket]
                while held < items and index < len(chunks):
                    chunk = chunks[index]
                    if chunk.job.closed or chunk.job.deadline <= now:
                        del chunks[index]
                        self._drop_dead(queue, bucket, chunk, expired)
                        continue
                    found.append((bucket, chunk))
                    held += chunk.items
                    index += 1
        return found, expired

    def take_items(self, bucket: int, chunk: Chunk, mask: np.ndarray) -> Chunk:
        """The items ``mask`` marks of a live chunk :meth:`front` found, as a chunk of their own; the
        rest stays in its place."""
        queue = self._classes[chunk.job.priority]
        chunks = queue.chunks[bucket]
        if mask.all():
            chunks.remove(chunk)
            taken = chunk
        else:
            taken, rest = chunk.select(mask)
            chunks[chunks.index(chunk)] = rest
        queue.items[bucket] -= taken.items
        queue.drop(chunk.job, taken.cost, stop_waiting=True)
        return taken

    def _take(
        self, queue: _ClassQueue, bucket: int, want: int, now: float, taken: list[Chunk], expired: list[Job]
    ) -> int:
        chunks = queue.chunks[bucket]
        while want and chunks:
            chunk = chunks.popleft()
            if chunk.job.closed or chunk.job.deadline <= now:
                self._drop_dead(queue, bucket, chunk, expired)
                continue
            if chunk.items > want:
                chunk, rest = chunk.split(want)
                chunks.appendleft(rest)
            queue.items[bucket] -= chunk.items
            queue.drop(chunk.job, chunk.cost, stop_waiting=True)
            taken.append(chunk)
            want -= chunk.items
        return want

    @staticmethod
    def _drop_dead(queue: _ClassQueue, bucket: int, chunk: Chunk, expired: list[Job]) -> None:
        """A chunk of a closed job, or of one past its deadline (reported once, to be closed), leaves."""
        queue.items[bucket] -= chunk.items
        # A closed job that was forgotten has nothing left to subtract.
        queue.drop(chunk.job, min(chunk.cost, chunk.job.queued_tokens), stop_waiting=False)
        if not chunk.job.closed and chunk.job not in expired:
            expired.append(chunk.job)

    def __len__(self) -> int:
        return sum(sum(c.items) for c in self._classes.values())

    def __bool__(self) -> bool:
        """Whether any chunk is queued, live or not: cheaper than counting them."""
        return any(any(c.items) for c in self._classes.values())
