"""The batching policy and the small event-driven loop that applies it.

Policy (``choose_batch``, pure): a stale bucket first (its oldest item waited ``max_wait``; the
oldest wins so no bucket starves), then a full bucket, then, only when the worker has nothing to
do, the bucket with the most queued tokens. When graphs are compiled, every batch takes one of a
fixed set of shapes (rows padded up to a power of two, length padded to the bucket's), so CUDA
graphs are captured once and replayed; in eager mode a batch is trimmed to its real rows and its
longest item, since padding there is only wasted work.

The naive policy (the ablation baseline, ``KEMBED_BATCHING=naive``) has one queue: whatever is
waiting goes as soon as the worker is free, padded to the longest item in the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from kembed.engine.buckets import BucketQueue
from kembed.engine.work import Batch, Chunk, Job
from kembed.shapes import BatchShapes

# Batches handed to the worker and not yet finished. With fixed shapes (CUDA graphs) a batch takes
# milliseconds, so one waits ready while another runs and the device never idles on the host. In
# eager mode (CPU) a batch takes a large fraction of a second: the next is formed only when the
# worker is free, from everything that queued meanwhile, so batches are larger and run faster per token.
IN_FLIGHT_FIXED = 2
IN_FLIGHT_EAGER = 1


@dataclass(frozen=True)
class Pick:
    bucket: int
    items: int  # to take from the bucket
    reason: str  # "stale", "full" or "idle"


def choose_batch(
    queue: BucketQueue, shapes: BatchShapes, now: float, max_wait: float, worker_idle: bool, naive: bool
) -> Pick | None:
    """Which bucket drains next, and how many items; None means wait."""
    waiting = [b for b in range(len(queue.bucket_lengths)) if queue.items(b)]
    if not waiting:
        return None

    def pick(bucket: int, reason: str) -> Pick:
        return Pick(bucket, min(queue.items(bucket), shapes.max_rows(queue.bucket_lengths[bucket])), reason)

    def age(bucket: int) -> float:
        oldest = queue.oldest(bucket)
        return now - oldest if oldest is not None else 0.0

    if not naive:
        stale = [b for b in waiting if age(b) >= max_wait]
        if stale:
            return pick(max(stale, key=age), "stale")
    full = [b for b in waiting if queue.items(b) >= shapes.max_rows(queue.bucket_lengths[b])]
    if full:
        return pick(max(full, key=age), "full")
    if worker_idle:
        return pick(max(waiting, key=lambda b: (queue.items(b) * queue.bucket_lengths[b], age(b))), "idle")
    return None


def next_stale_time(queue: BucketQueue, max_wait: float) -> float | None:
    """When the next bucket turns stale: the batcher's only timed wake-up."""
    oldest = [t for b in range(len(queue.bucket_lengths)) if (t := queue.oldest(b)) is not None]
    return min(oldest) + max_wait if oldest else None


class Batcher:
    """Owns the bucket queue; wakes on new work, a finished batch, or the next stale deadline."""

    def __init__(
        self,
        queue: BucketQueue,
        shapes: BatchShapes,
        dispatch: Callable[[Batch], None],
        *,
        expire: Callable[[Job], None],
        max_wait: float,
        naive: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.shapes = shapes
        self._dispatch = dispatch
        self._expire = expire  # a job found past its deadline: closed by whoever owns jobs
        self._max_wait = max_wait
        self._naive = naive
        self._clock = clock
        self._wake = asyncio.Event()
        self._in_flight_limit = IN_FLIGHT_FIXED if shapes.fixed else IN_FLIGHT_EAGER
        self.in_flight = 0
        self.in_flight_tokens = 0

    @property
    def backlog_tokens(self) -> int:
        """Padded tokens queued or being computed: what admission control weighs."""
        return self.queue.queued_tokens + self.in_flight_tokens

    def submit(self, parts: list[tuple[int, Chunk]]) -> None:
        """Queue (bucket, chunk) pairs and wake the loop."""
        for bucket, chunk in parts:
            self.queue.add(bucket, chunk)
        self._wake.set()

    def batch_done(self, batch: Batch) -> None:
        self.in_flight -= 1
        self.in_flight_tokens -= batch.padded_tokens
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            self._dispatch_ready()
            timeout = self._timeout()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _timeout(self) -> float | None:
        """Seconds until a bucket turns stale; None (wait for an event) when nothing could go anyway."""
        if self._naive or self.in_flight >= self._in_flight_limit:
            return None
        wake_at = next_stale_time(self.queue, self._max_wait)
        return None if wake_at is None else max(0.0, wake_at - self._clock())

    def _dispatch_ready(self) -> None:
        while self.in_flight < self._in_flight_limit:
            now = self._clock()
            pick = choose_batch(self.queue, self.shapes, now, self._max_wait, self.in_flight == 0, self._naive)
            if pick is None:
                return
            chunks, expired = self.queue.take(pick.bucket, pick.items, now)
            for job in expired:
                self._expire(job)
            if not chunks:
                continue  # only abandoned items were there
            items = sum(chunk.items for chunk in chunks)
            longest = max(int(chunk.lengths.max()) for chunk in chunks)
            seq_len = self.shapes.seq_len_for(self.queue.bucket_lengths[pick.bucket], longest)
            batch = Batch(chunks, seq_len, self.shapes.rows_for(items))
            self.in_flight += 1
            self.in_flight_tokens += batch.padded_tokens
            self._dispatch(batch)
