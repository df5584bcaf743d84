"""The batching policy and the small event-driven loop that applies it.

Policy (``choose_batch``, pure): a stale bucket first (its oldest item waited ``max_wait``; the
oldest wins so no bucket starves), then a full bucket, then, only when the worker has nothing to
do, the bucket with the most queued tokens. When graphs are compiled, every batch takes one of a
fixed set of shapes (rows padded up to a power of two, length padded to the bucket's), so CUDA
graphs are captured once and replayed; in eager mode a batch is trimmed to its real rows and its
longest item, since padding there is only wasted work.

Interactive work leads: while any is queued, the rules apply to it alone, and only a bucket
holding it may go; batch items of that bucket fill the rows its shape would pad (free with
compiled shapes; in eager mode there are none, since every row is computed and would delay the
interactive items). Otherwise the rules apply to batch work. A floor keeps batch work from
starving: batch work that has waited ``starved_after`` (the drain budget) with no batch of its
class started meanwhile goes next, the bucket of its oldest item, so interactive traffic that
fills the worker still leaves it a batch per ``starved_after``. Alongside interactive traffic
that does not, batch work is served all the time and the floor never acts (aging by an item's
age alone did: items of an ingest at saturation wait past any bound admission can estimate).

The naive policy (the ablation baseline, ``KEMBED_BATCHING=naive``) has one queue: whatever is
waiting goes as soon as the worker is free, padded to the longest item in the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kembed.admission import Backlog
from kembed.engine.buckets import BucketQueue
from kembed.engine.work import Batch, Chunk, Job
from kembed.priority import Priority
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
    reason: str  # "stale", "full", "idle" or "starved"
    first: Priority = Priority.INTERACTIVE  # whose items the bucket gives first


@dataclass(frozen=True)
class _Lead:
    """What a bucket's next batch would be formed around."""

    items: int  # the items that lead
    oldest: float  # when the oldest of them arrived
    whole: bool  # every item of the bucket leads (batch work alone, or aged), not its interactive items


def _leads(queue: BucketQueue) -> dict[int, _Lead]:
    """The buckets that may go, by what leads each: interactive work if there is any, else batch work."""
    leads, batch = {}, {}
    for bucket in range(len(queue.bucket_lengths)):
        if (interactive := queue.oldest(bucket, Priority.INTERACTIVE)) is not None:
            leads[bucket] = _Lead(queue.items(bucket, Priority.INTERACTIVE), interactive, whole=False)
        elif (oldest := queue.oldest(bucket, Priority.BATCH)) is not None:
            batch[bucket] = _Lead(queue.items(bucket), oldest, whole=True)
    return leads or batch


def starved_bucket(queue: BucketQueue, now: float, starved_after: float, batch_served_at: float) -> int | None:
    """The bucket of the oldest batch item, if batch work has waited ``starved_after`` with no batch
    of its class started since ``batch_served_at``; else None."""
    oldest = {b: t for b in range(len(queue.bucket_lengths)) if (t := queue.oldest(b, Priority.BATCH)) is not None}
    if not oldest:
        return None
    bucket = min(oldest, key=oldest.__getitem__)
    return bucket if now - max(oldest[bucket], batch_served_at) >= starved_after else None


def choose_batch(
    queue: BucketQueue,
    shapes: BatchShapes,
    now: float,
    max_wait: float,
    worker_idle: bool,
    naive: bool,
    starved_after: float = math.inf,
    batch_served_at: float = -math.inf,
) -> Pick | None:
    """Which bucket drains next, and how many items; None means wait."""
    if (starved := starved_bucket(queue, now, starved_after, batch_served_at)) is not None:
        most = shapes.max_rows(queue.bucket_lengths[starved])
        return Pick(starved, min(queue.items(starved), most), "starved", first=Priority.BATCH)
    leads = _leads(queue)
    if not leads:
        return None

    def pick(bucket: int, reason: str) -> Pick:
        lead, most = leads[bucket], shapes.max_rows(queue.bucket_lengths[bucket])
        rows = most if lead.whole else shapes.rows_for(min(lead.items, most))
        return Pick(bucket, min(queue.items(bucket), rows), reason)

    def age(bucket: int) -> float:
        return now - leads[bucket].oldest

    if not naive:
        stale = [b for b in leads if age(b) >= max_wait]
        if stale:
            return pick(max(stale, key=age), "stale")
    full = [b for b in leads if leads[b].items >= shapes.max_rows(queue.bucket_lengths[b])]
    if full:
        return pick(max(full, key=age), "full")
    if worker_idle:
        return pick(max(leads, key=lambda b: (leads[b].items * queue.bucket_lengths[b], age(b))), "idle")
    return None


def next_stale_time(queue: BucketQueue, max_wait: float) -> float | None:
    """When the next bucket that may go turns stale: the batcher's only timed wake-up. (Starved
    batch work needs none: interactive work that starves it keeps finishing batches, each a wake-up.)"""
    leads = _leads(queue)
    return min(lead.oldest for lead in leads.values()) + max_wait if leads else None


def interactive_tokens(batch: Batch) -> int:
    """The padded tokens of a batch's interactive items (its padding rows are not theirs)."""
    return batch.seq_len * sum(chunk.items for chunk in batch.chunks if chunk.job.priority is Priority.INTERACTIVE)


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
        starved_after: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.shapes = shapes
        self._dispatch = dispatch
        self._expire = expire  # a job found past its deadline: closed by whoever owns jobs
        self._max_wait = max_wait
        self._naive = naive
        self._starved_after = starved_after  # batch work left this long without a batch goes next
        self._batch_served_at = -math.inf  # when a batch holding batch work last started or finished
        self._clock = clock
        self._wake = asyncio.Event()
        self._in_flight_limit = IN_FLIGHT_FIXED if shapes.fixed else IN_FLIGHT_EAGER
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.in_flight_interactive = 0  # of in_flight_tokens: interactive items' rows, what queries wait behind

    @property
    def backlog_tokens(self) -> int:
        """Padded tokens queued or being computed."""
        return self.queue.queued_tokens + self.in_flight_tokens

    @property
    def backlog(self) -> Backlog:
        """The same by class: what admission control weighs."""
        return Backlog(
            interactive=self.queue.tokens(Priority.INTERACTIVE),
            batch=self.queue.tokens(Priority.BATCH),
            in_flight=self.in_flight_tokens,
            displaceable=self.queue.waiting_tokens(Priority.BATCH),
            in_flight_interactive=self.in_flight_interactive,
        )

    def submit(self, parts: list[tuple[int, Chunk]]) -> None:
        """Queue (bucket, chunk) pairs and wake the loop."""
        for bucket, chunk in parts:
            self.queue.add(bucket, chunk)
        self._wake.set()

    def batch_done(self, batch: Batch) -> None:
        self.in_flight -= 1
        self.in_flight_tokens -= batch.padded_tokens
        self.in_flight_interactive -= interactive_tokens(batch)
        if any(chunk.job.priority is Priority.BATCH for chunk in batch.chunks):
            # Measured from its end: a batch of ingest longer than the floor (a slow node) would
            # otherwise make batch work starved again the moment it finished, every time, and the
            # queries waiting behind it would wait for the whole ingest.
            self._batch_served_at = self._clock()
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
            pick = choose_batch(
                self.queue,
                self.shapes,
                now,
                self._max_wait,
                self.in_flight == 0,
                self._naive,
                self._starved_after,
                self._batch_served_at,
            )
            if pick is None:
                return
            chunks, expired = self.queue.take(pick.bucket, pick.items, now, pick.first)
            if any(chunk.job.priority is Priority.BATCH for chunk in chunks):
                self._batch_served_at = now
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
            self.in_flight_interactive += interactive_tokens(batch)
            self._dispatch(batch)
