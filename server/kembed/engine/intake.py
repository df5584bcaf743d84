"""The engine's door: a front end's WORK frame becomes admitted jobs in the buckets, refusals sent
back, cancellations applied and latency samples counted.

Front ends pre-screen against the board; this is the final word, against the global backlog that
every front end's requests share. Each request arrives with the padded cost its front end computed
(the engine does not compute it again); the decision and the cut into chunks loop per request, a
one-item request without routing. A frame's interactive requests are decided first: one that the
queue cap would refuse displaces the youngest batch requests queued before the frame and not
started, which are refused in its place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kembed.domain.errors import EmbedError, Failure
from kembed.domain.inputs import Sequences
from kembed.engine.batcher import Batcher
from kembed.engine.buckets import route
from kembed.engine.jobs import Jobs
from kembed.engine.units import Chunk, Job, Replies
from kembed.ipc.protocol import Work
from kembed.metrics import EngineMetrics
from kembed.policy.admission import AdmissionController, Backlog, lapsing
from kembed.policy.load import MeasuredLoad
from kembed.policy.priority import BY_VALUE, Priority
from kembed.policy.shapes import bucket_of

log = logging.getLogger(__name__)

ONE_SLOT = np.zeros(1, dtype=np.int64)  # the only item of a one-item request (never written to)


class Intake:
    def __init__(
        self,
        admission: AdmissionController,
        load: MeasuredLoad,
        batcher: Batcher,
        jobs: Jobs,
        replies: Replies,
        metrics: EngineMetrics,
        pad_token_id: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._admission = admission
        self._load = load  # the measurements admission weighs against, where latency samples go
        self._batcher = batcher
        self._jobs = jobs
        self._replies = replies
        self._metrics = metrics
        self._pad = pad_token_id
        self._bucket_lengths = batcher.queue.bucket_lengths
        self._ladder = np.asarray(self._bucket_lengths)  # for ``bucket_of``, converted once
        self._clock = clock

    def accept(self, link_id: int, work: Work) -> None:
        load = self._load
        kinds = zip(work.sample_priorities.tolist(), work.sample_refused.tolist(), strict=True)
        for seconds, (priority, refused) in zip(work.latencies.tolist(), kinds, strict=True):
            if refused:
                load.add_refusal(seconds, BY_VALUE[priority])
            else:
                load.add_latency(seconds, BY_VALUE[priority])
        for tag in work.cancels.tolist():
            self._jobs.cancel(link_id, tag)
        if work.tags.size:
            self._admit(link_id, work)

    def backlog(self) -> Backlog:
        """What admission weighs: the batcher's backlog, with the queued work of each class that
        will expire before the worker could reach it (by the class's latest deadline) set apart."""
        backlog, now, rate = self._batcher.backlog, self._clock(), self._load.tokens_per_second
        return backlog.with_lapsing(
            lapsing(backlog.interactive, rate, self._jobs.latest_deadline(Priority.INTERACTIVE), now),
            lapsing(backlog.batch, rate, self._jobs.latest_deadline(Priority.BATCH), now),
        )

    def _admit(self, link_id: int, work: Work) -> None:
        jobs: list[Job | None] = [None] * work.tags.size
        refused, refusals = [], []
        backlog = self.backlog()
        tags, deadlines, counts, costs, priorities = (
            part.tolist() for part in (work.tags, work.deadlines, work.counts, work.costs, work.priorities)
        )
        # Each request's id, read only when its lines are written: a frame's rows pay nothing for it.
        named = work.request_id_list() if log.isEnabledFor(logging.DEBUG) else None
        for i in sorted(range(len(tags)), key=priorities.__getitem__):  # interactive first, in order
            priority, cost = BY_VALUE[priorities[i]], costs[i]
            rejection = self._admission.admit(cost, backlog, priority)
            if rejection is not None:
                self._metrics.rejected.labels(reason=rejection.reason, priority=priority.label).inc()
                refused.append(tags[i])
                refusals.append(EmbedError(Failure.REJECTED, rejection.message, rejection.retry_after_ms))
                if named is not None:
                    log.debug("refused (%s): %s", rejection.reason, rejection.message, extra={"request_id": named[i]})
                continue
            if room := self._admission.room_to_make(cost, backlog, priority):
                backlog = self._displace(room, backlog)
            backlog = backlog.plus(cost, priority)
            job = Job(link_id=link_id, tag=tags[i], count=counts[i], deadline=deadlines[i], priority=priority)
            self._jobs.add(job)
            jobs[i] = job
            if named is not None:
                line = "admitted: %d items, %d padded tokens, %s"
                log.debug(line, counts[i], cost, priority.label, extra={"request_id": named[i]})
        if refused:
            self._replies.errors(link_id, refused, refusals)
        if len(refused) < len(jobs):
            self._batcher.submit(self._chunks(work, jobs))

    def _displace(self, tokens: int, backlog: Backlog) -> Backlog:
        """Refuse the youngest batch requests not started that hold ``tokens``; the backlog without them."""
        for job in self._batcher.queue.youngest_waiting(Priority.BATCH, tokens):
            held = job.queued_tokens
            self._jobs.displace(job)
            backlog = backlog.without_batch(held)
            rejection = self._admission.displaced(held, backlog)
            self._metrics.rejected.labels(reason=rejection.reason, priority=Priority.BATCH.label).inc()
            error = EmbedError(Failure.REJECTED, rejection.message, rejection.retry_after_ms)
            self._replies.errors(job.link_id, [job.tag], [error])
        return backlog

    def _chunks(self, work: Work, jobs: list[Job | None]) -> list[tuple[int, Chunk]]:
        """Each admitted request's items as chunks, one per bucket it uses. A one-item request (the
        common case at high call rates) is padded with two array operations and no routing."""
        now = self._clock()
        lengths = work.lengths
        ends = np.cumsum(lengths, dtype=np.int64).tolist()  # where each item's ids end in ``work.ids``
        buckets = bucket_of(lengths, self._ladder).tolist()
        parts, end = [], 0  # the item after the request's last
        for job, count in zip(jobs, work.counts.tolist(), strict=True):
            first, end = end, end + count
            if job is None:
                continue
            offset = ends[first] - int(lengths[first])
            if count == 1:
                bucket = buckets[first]
                ids = np.full((1, self._bucket_lengths[bucket]), self._pad, dtype=np.int32)
                ids[0, : ends[first] - offset] = work.ids[offset : ends[first]]
                parts.append((bucket, Chunk(job, ONE_SLOT, ids, lengths[first:end], now)))
                continue
            seqs = Sequences(work.ids[offset : ends[end - 1]], lengths[first:end])
            for routed in route(seqs, self._bucket_lengths, self._pad):
                parts.append((routed.bucket, Chunk(job, routed.items, routed.ids, routed.lengths, now)))
        return parts
