"""Routes each finished batch back to the requests it served: one call per batch, one numpy
copy per chunk, and a request's future resolves when its last item lands."""

from __future__ import annotations

import time
from collections.abc import Callable

from kembed.admission import AdmissionController
from kembed.batcher import Batcher
from kembed.metrics import Metrics
from kembed.work import Batch
from kembed.worker import Outcome


class BatchFailed(RuntimeError):
    """The model raised on this request's items alone (its batch-mates were retried without it)."""


class Responder:
    def __init__(
        self,
        batcher: Batcher,
        admission: AdmissionController,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._batcher = batcher
        self._admission = admission
        self._metrics = metrics
        self._clock = clock
        self._last_done = 0.0

    def deliver(self, batch: Batch, outcomes: list[Outcome], started: float, seconds: float) -> None:
        """Runs on the event loop, called by the worker thread through call_soon_threadsafe."""
        self._batcher.batch_done(batch)
        now = self._clock()
        # The rate admission relies on is measured here, at completion, in wall time from when the
        # batch could start (its own start or the previous completion) to its answer on the loop:
        # compute time alone misses the gaps a busy event loop and shared cores put between batches.
        wall = now - max(started, self._last_done)
        self._last_done = now
        padded = sum(outcome.padded_tokens for outcome in outcomes)
        if padded:
            self._admission.rate.record(padded, max(seconds, wall))
            real = sum(outcome.real_tokens for outcome in outcomes)
            self._metrics.observe_batch(batch.rows, padded, real, seconds)
        for outcome in outcomes:
            self._route(outcome, started, seconds)

    def _route(self, outcome: Outcome, started: float, seconds: float) -> None:
        offset = 0
        for chunk in outcome.chunks:
            job = chunk.job
            if outcome.embeddings is None:
                job.close(BatchFailed(f"inference failed: {outcome.error}"))
                continue
            if not job.closed:
                job.rows[chunk.rows] = outcome.embeddings[offset : offset + chunk.size]
                job.remaining -= chunk.size
                job.inference_s += seconds
                job.last_start = max(job.last_start, started)
                if job.remaining == 0:
                    job.close()
            offset += chunk.size
