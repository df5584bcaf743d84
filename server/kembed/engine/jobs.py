"""The engine's table of admitted requests, by front end and tag: what a cancellation, a finished
batch, an expired deadline or a lost front end finds its requests by. Jobs are closed here and
nowhere else."""

from __future__ import annotations

from kembed.engine.buckets import BucketQueue
from kembed.engine.units import Job


class Jobs:
    def __init__(self, queue: BucketQueue) -> None:
        self._queue = queue
        self._open: dict[tuple[int, int], Job] = {}

    def __len__(self) -> int:
        """Requests admitted and not yet closed."""
        return len(self._open)

    def add(self, job: Job) -> None:
        self._open[job.link, job.tag] = job

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
