"""The batching policy and the small event-driven loop that applies it.

Policy (``choose_batch``, pure): a stale bucket first (its oldest item waited ``max_wait``; the
oldest wins so no bucket starves), then a full bucket, then, only when the worker has nothing to
do, the bucket with the most queued tokens. That bucket leads the next batch.

How the batch is formed follows the device. When graphs are compiled, every batch takes one of a
fixed set of shapes (rows padded up to a power of two, length padded to the bucket's), so CUDA
graphs are captured once and replayed: a batch is items of the lead bucket alone. In eager mode
(CPU) nothing is captured and any shape is as good as another, so a batch is *packed* (``pack``,
pure): the items at the front of the lead bucket and of its two neighbours, sorted by length, are
split into the runs of consecutive lengths that compute them all at the least cost (a batch costs
its padded tokens, rows x its longest item, plus a fixed overhead the warmup measures), within the
token budget and the row limit; the run that holds the lead's oldest item goes. Items of similar
length from either side of a bucket boundary go together, so padding is lower than within one
bucket, and batches are as large as the overhead makes worth it; the items left out wait for a
batch of their own lengths.

Interactive work leads: while any is queued, the rules apply to it alone, and only a bucket
holding it may go; ingest items of that bucket fill the rows its shape would pad (free with
compiled shapes; in eager mode there are none, since every row is computed and would delay the
interactive items, so a packed batch led by interactive work holds interactive items only).
Otherwise the rules apply to ingest (the batch class). A floor keeps ingest from starving: ingest that
has waited ``starved_after`` (the drain budget) with no batch of its class started meanwhile goes
next, the bucket of its oldest item (why a floor and not aging: docs/decisions/priority-classes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kembed.engine.buckets import EVERY_CLASS, BucketQueue
from kembed.engine.units import Batch, Chunk, Job
from kembed.policy.admission import Backlog
from kembed.policy.priority import Priority
from kembed.policy.shapes import BatchShapes

# Batches handed to the worker and not yet finished. With fixed shapes (CUDA graphs) a batch takes
# milliseconds, so one waits ready while another runs and the device never idles on the host. In
# eager mode (CPU) a batch takes a large fraction of a second: one per lane (``BatchPolicy.lanes``),
# the next formed only when a lane is free, from everything that queued meanwhile, so batches are
# larger and run faster per token.
IN_FLIGHT_FIXED = 2

INTERACTIVE_ONLY = (Priority.INTERACTIVE,)
BATCH_FIRST = (Priority.BATCH, Priority.INTERACTIVE)
ONE_ITEM = np.ones(1, dtype=bool)  # the mask that takes a one-item chunk whole (never written to)


@dataclass(frozen=True)
class BatchPolicy:
    """The batcher's rules, fixed once the model is warm."""

    shapes: BatchShapes
    max_wait: float  # seconds: a bucket whose oldest item waited this long is stale
    starved_after: float = math.inf  # seconds ingest may go without a batch of its class
    packed: bool = False  # eager batches packed by length across neighbouring buckets (see ``pack``)
    overhead_tokens: float = 0.0  # a batch's cost beyond its padded tokens, in tokens: what packing weighs
    lanes: int = 1  # batches the worker computes at once

    @property
    def in_flight(self) -> int:
        return IN_FLIGHT_FIXED if self.shapes.fixed else self.lanes


@dataclass(frozen=True)
class Pick:
    bucket: int  # the lead bucket
    items: int  # to take from it (packed: the most rows)
    reason: str  # "stale", "full", "idle" or "starved"
    classes: tuple[Priority, ...] = EVERY_CLASS  # whose items the batch may hold, in the order taken


@dataclass(frozen=True)
class _Lead:
    """What a bucket's next batch would be formed around."""

    items: int  # the items that lead
    oldest: float  # when the oldest of them arrived
    whole: bool  # every item of the bucket leads (ingest alone, or aged), not its interactive items


def _leads(queue: BucketQueue) -> dict[int, _Lead]:
    """The buckets that may go, by what leads each: interactive work if there is any, else ingest."""
    leads, batch = {}, {}
    for bucket in range(len(queue.bucket_lengths)):
        if (interactive := queue.oldest(bucket, Priority.INTERACTIVE)) is not None:
            leads[bucket] = _Lead(queue.items(bucket, Priority.INTERACTIVE), interactive, whole=False)
        elif (oldest := queue.oldest(bucket, Priority.BATCH)) is not None:
            batch[bucket] = _Lead(queue.items(bucket), oldest, whole=True)
    return leads or batch


def starved_bucket(queue: BucketQueue, now: float, starved_after: float, batch_served_at: float) -> int | None:
    """The bucket of the oldest ingest item, if ingest has waited ``starved_after`` with no batch
    of its class started since ``batch_served_at``; else None."""
    oldest = {b: t for b in range(len(queue.bucket_lengths)) if (t := queue.oldest(b, Priority.BATCH)) is not None}
    if not oldest:
        return None
    bucket = min(oldest, key=oldest.__getitem__)
    return bucket if now - max(oldest[bucket], batch_served_at) >= starved_after else None


def choose_batch(
    queue: BucketQueue, *, policy: BatchPolicy, now: float, idle: bool, batch_served_at: float = -math.inf
) -> Pick | None:
    """Which bucket leads the next batch, how many of its items and of which classes; None means
    wait. ``idle``: a lane of the worker has nothing to do; ``batch_served_at``: when a batch holding batch
    work last started."""
    if not queue:  # the common answer once a one-call frame's batch has formed: at once
        return None
    shapes = policy.shapes
    if (starved := starved_bucket(queue, now, policy.starved_after, batch_served_at)) is not None:
        most = shapes.max_rows(queue.bucket_lengths[starved])
        return Pick(starved, min(queue.items(starved), most), "starved", BATCH_FIRST)
    leads = _leads(queue)
    if not leads:
        return None

    def pick(bucket: int, reason: str) -> Pick:
        lead, most = leads[bucket], shapes.max_rows(queue.bucket_lengths[bucket])
        if lead.whole:
            return Pick(bucket, min(queue.items(bucket), most), reason)
        rows = shapes.rows_for(min(lead.items, most))  # compiled: ingest items fill the rows it pads
        return Pick(bucket, min(queue.items(bucket), rows), reason, EVERY_CLASS if shapes.fixed else INTERACTIVE_ONLY)

    def age(bucket: int) -> float:
        return now - leads[bucket].oldest

    stale = [b for b in leads if age(b) >= policy.max_wait]
    if stale:
        return pick(max(stale, key=age), "stale")
    full = [b for b in leads if leads[b].items >= shapes.max_rows(queue.bucket_lengths[b])]
    if full:
        return pick(max(full, key=age), "full")
    if idle:
        return pick(max(leads, key=lambda b: (leads[b].items * queue.bucket_lengths[b], age(b))), "idle")
    return None


def pack(lengths: np.ndarray, lead: int, max_rows: int, max_tokens: int, overhead: float) -> np.ndarray:
    """Which items a packed batch takes (indices into ``lengths``, the lead's among them). The items,
    sorted by length, are split into runs of consecutive lengths, each at most ``max_rows`` items and
    ``max_tokens`` padded to its longest (a lone item may be longer), so that computing every run as
    a batch costs the least, a batch costing its padded tokens plus ``overhead``; the run that holds
    item ``lead`` goes now. The rest wait, and arrivals meanwhile may pack them better.

    One pass of dynamic programming over the sorted lengths, in plain Python: at most a few hundred
    candidates, where numpy's per-call cost would dominate (5-10x slower measured)."""
    order = np.argsort(lengths, kind="stable")
    ranked = lengths[order].tolist()
    least = [0.0] * (len(ranked) + 1)  # least[j]: the cost of the first j items, split best
    start = [0] * (len(ranked) + 1)  # where the last run of that split starts
    for end in range(1, len(ranked) + 1):
        longest, best, begins = ranked[end - 1], math.inf, end - 1  # sorted: a run's last item is its longest
        for first in range(end - 1, max(0, end - max_rows) - 1, -1):
            padded = (end - first) * longest
            if padded > max_tokens and first < end - 1:
                break  # longer runs only pad more
            if least[first] + padded <= best:  # ties: the longer run
                best, begins = least[first] + padded, first
        least[end], start[end] = best + overhead, begins
    at, end = int(np.flatnonzero(order == lead)[0]), len(ranked)
    while start[end] > at:
        end = start[end]
    return order[start[end] : end]


def next_stale_time(queue: BucketQueue, max_wait: float) -> float | None:
    """When the next bucket that may go turns stale: the batcher's only timed wake-up. (Starved
    ingest needs none: interactive work that starves it keeps finishing batches, each a wake-up.)"""
    if not queue:
        return None
    leads = _leads(queue)
    return min(lead.oldest for lead in leads.values()) + max_wait if leads else None


def interactive_tokens(batch: Batch) -> int:
    """What a batch's interactive items took from the backlog (its padding rows are not theirs)."""
    return sum(chunk.cost for chunk in batch.chunks if chunk.job.priority is Priority.INTERACTIVE)


class Batcher:
    """Owns the bucket queue; wakes on new work, a finished batch, or the next stale deadline."""

    def __init__(
        self,
        queue: BucketQueue,
        policy: BatchPolicy,
        dispatch: Callable[[Batch], None],
        *,
        expire: Callable[[Job], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.policy = policy
        self._dispatch = dispatch
        self._expire = expire  # a job found past its deadline: closed by whoever owns jobs
        self._batch_served_at = -math.inf  # when a batch holding ingest last started or finished
        self._clock = clock
        self._wake = asyncio.Event()
        self.in_flight = 0
        self.in_flight_tokens = 0  # the cost of the batches in flight
        self.in_flight_interactive = 0  # of in_flight_tokens: interactive items', what queries wait behind

    @property
    def backlog(self) -> Backlog:
        """Padded tokens queued or being computed, by class: what admission control weighs."""
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
        self.in_flight_tokens -= batch.cost
        self.in_flight_interactive -= interactive_tokens(batch)
        if any(chunk.job.priority is Priority.BATCH for chunk in batch.chunks):
            # Measured from its end: a batch of ingest longer than the floor (a slow node) would
            # otherwise make ingest starved again the moment it finished, every time, and the
            # queries waiting behind it would wait for the whole ingest.
            self._batch_served_at = self._clock()
        if self.queue:  # a lane is free for what waits (with none queued, new work wakes the loop)
            self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            self.dispatch_ready()
            timeout = self._timeout()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _timeout(self) -> float | None:
        """Seconds until a bucket turns stale; None (wait for an event) when nothing could go anyway."""
        if self.in_flight >= self.policy.in_flight:
            return None
        wake_at = next_stale_time(self.queue, self.policy.max_wait)
        return None if wake_at is None else max(0.0, wake_at - self._clock())

    def dispatch_ready(self) -> None:
        """Form and hand over every batch the rules allow now (the loop's step)."""
        shapes = self.policy.shapes
        while self.in_flight < self.policy.in_flight:
            now = self._clock()
            pick = choose_batch(
                self.queue,
                policy=self.policy,
                now=now,
                idle=self.in_flight < self.policy.lanes,
                batch_served_at=self._batch_served_at,
            )
            if pick is None:
                return
            chunks, expired = self._packed(pick, now) if self.policy.packed else self._bucket(pick, now)
            for job in expired:
                self._expire(job)
            if not chunks:
                continue  # only abandoned items were there
            if any(chunk.job.priority is Priority.BATCH for chunk in chunks):
                self._batch_served_at = now
            items = sum(chunk.items for chunk in chunks)
            longest = max(int(chunk.lengths.max()) for chunk in chunks)
            seq_len = shapes.seq_len_for(self.queue.bucket_lengths[pick.bucket], longest)
            batch = Batch(chunks, seq_len, shapes.rows_for(items))
            self.in_flight += 1
            self.in_flight_tokens += batch.cost
            self.in_flight_interactive += interactive_tokens(batch)
            self._dispatch(batch)

    def _bucket(self, pick: Pick, now: float) -> tuple[list[Chunk], list[Job]]:
        """The items the pick names, from its bucket alone."""
        return self.queue.take(pick.bucket, pick.items, now, pick.classes)

    def _packed(self, pick: Pick, now: float) -> tuple[list[Chunk], list[Job]]:
        """The lead bucket's oldest item and the items of similar length ``pack`` adds to it, from the
        fronts of the lead bucket and its neighbours."""
        neighbours = [b for b in (pick.bucket - 1, pick.bucket + 1) if 0 <= b < len(self.queue.bucket_lengths)]
        rows = self.policy.shapes.sizes[-1]
        found, expired = self.queue.front([pick.bucket, *neighbours], pick.classes, rows, now)
        if not found or found[0][0] != pick.bucket:  # the lead's items were all abandoned: pick again
            return [], expired
        if len(found) == 1 and found[0][1].items == 1:  # a lone item (one call a frame) goes alone
            return [self.queue.take_items(pick.bucket, found[0][1], ONE_ITEM)], expired
        lengths = np.concatenate([chunk.lengths for _, chunk in found])
        chosen = np.zeros(len(lengths), dtype=bool)
        chosen[pack(lengths, 0, rows, self.policy.shapes.max_tokens, self.policy.overhead_tokens)] = True
        taken, start = [], 0
        for bucket, chunk in found:
            mask = chosen[start : start + chunk.items]
            start += chunk.items
            if mask.any():
                taken.append(self.queue.take_items(bucket, chunk, mask))
        return taken, expired
