"""The engine's table of admitted requests, by front end and tag: what a cancellation, a finished
batch, an expired deadline or a lost front end finds its requests by. Jobs are closed here and
nowhere else.

Jobs are also kept in order of their deadlines: a job is closed as its deadline passes
(:meth:`Jobs.expire_due`, driven by a timer at :meth:`Jobs.next_deadline`), whether or not its front
end's cancellation has come and whatever the batcher has reached, so the queue stops counting its
tokens; and the latest deadline of each class's open jobs (:meth:`Jobs.latest_deadline`) says when
all of that class's queued work will be gone, so admission does not weigh work that will expire
before it could run.
"""

from __future__ import annotations

import heapq
import itertools
import math

from kembed.engine.buckets import BucketQueue
from kembed.engine.units import Job
from kembed.policy.priority import Priority

# The deadline heap drops closed jobs lazily; rebuilt when they are most of it, so its memory stays
# within a small multiple of the open jobs'.
COMPACT_SLACK = 64


class Jobs:
    def __init__(self, queue: BucketQueue) -> None:
        self._queue = queue
        self._open: dict[tuple[int, int], Job] = {}
        self._deadlines = _Heap()  # earliest first
        self._latest = {priority: _Heap() for priority in Priority}  # latest first (negated deadlines)

    def __len__(self) -> int:
        """Requests admitted and not yet closed."""
        return len(self._open)

    def add(self, job: Job) -> None:
        self._open[job.link_id, job.tag] = job
        self._deadlines.push(job.deadline, job, len(self._open))
        self._latest[job.priority].push(-job.deadline, job, len(self._open))

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
        while (job := self._deadlines.pop_until(now)) is not None:
            self.expire(job)
            closed += 1
        return closed

    def next_deadline(self) -> float | None:
        """The earliest deadline of an open job (None when none is open)."""
        return self._deadlines.first()

    def latest_deadline(self, priority: Priority) -> float:
        """The latest deadline of the class's open jobs (-inf when none is open): by then all of
        the class's queued work is gone, computed or expired."""
        first = self._latest[priority].first()
        return -math.inf if first is None else -first

    def displace(self, job: Job) -> None:
        """Batch work none of whose items started gave its place to interactive work: the intake
        tells its front end."""
        self._close(job)

    def cancel(self, link_id: int, tag: int) -> None:
        """The front end stopped waiting (deadline, client gone): queued items are dropped."""
        job = self._open.get((link_id, tag))
        if job is not None:
            self._close(job)

    def drop_link(self, link_id: int) -> None:
        """A front end went away: none of its requests can be answered."""
        for key in [key for key in self._open if key[0] == link_id]:
            self._close(self._open[key])

    def _close(self, job: Job) -> None:
        job.closed = True
        self._open.pop((job.link_id, job.tag), None)
        self._queue.forget(job)


class _Heap:
    """Open jobs by a key, smallest first; closed jobs are dropped lazily, and the heap rebuilt when
    they are most of it, so its memory stays within a small multiple of the open jobs'."""

    def __init__(self) -> None:
        self._entries: list[tuple[float, int, Job]] = []  # the int breaks ties in admission order
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, key: float, job: Job, open_jobs: int) -> None:
        heapq.heappush(self._entries, (key, next(self._order), job))
        if len(self._entries) > 2 * open_jobs + COMPACT_SLACK:
            self._entries = [entry for entry in self._entries if not entry[2].closed]
            heapq.heapify(self._entries)

    def first(self) -> float | None:
        """The smallest key of an open job."""
        entries = self._entries
        while entries and entries[0][2].closed:
            heapq.heappop(entries)
        return entries[0][0] if entries else None

    def pop_until(self, key: float) -> Job | None:
        """The open job of the smallest key, if that key is at most ``key``, taken off."""
        first = self.first()
        return heapq.heappop(self._entries)[2] if first is not None and first <= key else None
