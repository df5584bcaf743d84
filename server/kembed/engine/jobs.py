"""The engine's table of admitted requests, by front end and tag: what a cancellation, a finished
batch, an expired deadline or a lost front end finds its requests by. Jobs are closed here and
nowhere else.

Jobs are also kept in order of their deadlines, so that a job is closed as its deadline passes
(:meth:`Jobs.expire_due`, driven by a timer at :meth:`Jobs.next_deadline`), not only when the
batcher reaches its chunks: until then the queue would count its tokens, and new requests would be
weighed, and refused, against work that will never run.
"""

from __future__ import annotations

import heapq
import itertools

from kembed.engine.buckets import BucketQueue
from kembed.engine.work import Job

# The deadline heap drops closed jobs lazily; rebuilt when they are most of it, so its memory stays
# within a small multiple of the open jobs'.
COMPACT_SLACK = 64


class Jobs:
    def __init__(self, queue: BucketQueue) -> None:
        self._queue = queue
        self._open: dict[tuple[int, int], Job] = {}
        self._deadlines: list[tuple[float, int, Job]] = []  # a heap; the int breaks ties in admission order
        self._order = itertools.count()

    def __len__(self) -> int:
        """Requests admitted and not yet closed."""
        return len(self._open)

    def add(self, job: Job) -> None:
        self._open[job.link, job.tag] = job
        heapq.heappush(self._deadlines, (job.deadline, next(self._order), job))
        if len(self._deadlines) > 2 * len(self._open) + COMPACT_SLACK:
            self._deadlines = [entry for entry in self._deadlines if not entry[2].closed]
            heapq.heapify(self._deadlines)

    def complete(self, job: Job, items: int) -> bool:
        """``items`` of the job were computed; False if nobody waits for them any more."""
        if job.closed:
            return False
        job.remaining -= items
        if job.remaining == 0:
            self._close(job)
        return True

    def fail(self, job: Job) -> bool:
        """The job failed; False if it was already closed (nothing to report)."""
        if job.closed:
            return False
        self._close(job)
        return True

    def expire(self, job: Job) -> None:
        """Its deadline passed before its items were computed: the front end answers it itself."""
        self._close(job)

    def expire_due(self, now: float) -> int:
        """Close every open job whose deadline has passed; how many were closed."""
        closed = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            job = heapq.heappop(self._deadlines)[2]
            if not job.closed:
                self.expire(job)
                closed += 1
        return closed

    def next_deadline(self) -> float | None:
        """The earliest deadline of an open job (None when none is open)."""
        while self._deadlines and self._deadlines[0][2].closed:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def displace(self, job: Job) -> None:
        """Batch work none of whose items started gave its place to interactive work: the intake
        tells its front end."""
        self._close(job)

    def cancel(self, link: int, tag: int) -> None:
        """The front end stopped waiting (deadline, client gone): queued items are dropped."""
        job = self._open.get((link, tag))
        if job is not None:
            self._close(job)

    def drop_link(self, link: int) -> None:
        """A front end went away: none of its requests can be answered."""
        for key in [key for key in self._open if key[0] == link]:
            self._close(self._open[key])

    def _close(self, job: Job) -> None:
        job.closed = True
        self._open.pop((job.link, job.tag), None)
        self._queue.forget(job)
