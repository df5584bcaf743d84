"""Routes each finished batch back to the front ends that asked: one RESULT frame per front end per
batch, holding that front end's rows; the rows of requests nobody waits for any more are dropped."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from kembed.domain.errors import EmbedError, Failure
from kembed.engine.batcher import Batcher
from kembed.engine.jobs import Jobs
from kembed.engine.units import Batch, Chunk, Computed, Outcome, Replies
from kembed.ipc.protocol import Result
from kembed.metrics import EngineMetrics
from kembed.policy.load import ServiceRate


class Responder:
    def __init__(
        self,
        batcher: Batcher,
        rate: ServiceRate,
        jobs: Jobs,
        replies: Replies,
        metrics: EngineMetrics,
        clock: Callable[[], float] = time.monotonic,
        lanes: int = 1,
    ) -> None:
        self._batcher = batcher
        self._rate = rate
        self._jobs = jobs
        self._replies = replies
        self._metrics = metrics
        self._clock = clock
        self._last_done = [0.0] * lanes  # each lane's last answer on the loop

    def deliver(self, batch: Batch, outcomes: list[Outcome], computed: Computed) -> None:
        """Runs on the event loop, called by the worker thread through call_soon_threadsafe."""
        self._batcher.batch_done(batch)
        now, started, seconds = self._clock(), computed.started, computed.seconds
        # The rate admission relies on is measured here, at completion, in wall time from when the
        # batch could start (its own start or its lane's previous completion) to its answer on the
        # loop: compute time alone misses the gaps a busy event loop and shared cores put between
        # batches. The lanes compute side by side, so each holds its share of the worker's time.
        wall = now - max(started, self._last_done[computed.lane])
        self._last_done[computed.lane] = now
        done = [outcome for outcome in outcomes if outcome.padded_tokens]
        if done:
            # In the backlog's unit (each item padded to its bucket), so the drain time it gives is right.
            cost = sum(chunk.cost for outcome in done for chunk in outcome.chunks)
            self._rate.record(cost, max(seconds, wall) / len(self._last_done))
            padded = sum(outcome.padded_tokens for outcome in done)
            real = sum(outcome.real_tokens for outcome in done)
            self._metrics.observe_batch(batch.rows, padded, real, seconds)
        for outcome in outcomes:
            if outcome.embeddings is None:
                self._fail(outcome)
            else:
                self._send_rows(outcome.chunks, outcome.embeddings, started, seconds)

    def _send_rows(self, chunks: list[Chunk], embeddings: np.ndarray, started: float, seconds: float) -> None:
        by_link: dict[int, list[tuple[Chunk, int]]] = defaultdict(list)
        offset = 0
        for chunk in chunks:
            if self._jobs.complete(chunk.job, chunk.items):
                by_link[chunk.job.link_id].append((chunk, offset))
            offset += chunk.items
        for link_id, owned in by_link.items():
            tags = np.concatenate([np.full(chunk.items, chunk.job.tag, dtype=np.uint64) for chunk, _ in owned])
            slots = np.concatenate([chunk.slots for chunk, _ in owned]).astype(np.uint32)
            rows = np.concatenate([embeddings[start : start + chunk.items] for chunk, start in owned])
            self._replies.result(link_id, Result(started, seconds, tags, slots, rows))

    def _fail(self, outcome: Outcome) -> None:
        """The model raised on these chunks alone (their batch-mates were retried without them)."""
        failed: dict[int, list[int]] = defaultdict(list)
        for chunk in outcome.chunks:
            if self._jobs.fail(chunk.job):
                failed[chunk.job.link_id].append(chunk.job.tag)
        error = EmbedError(Failure.INTERNAL, f"inference failed: {outcome.error}")
        for link_id, tags in failed.items():
            self._replies.errors(link_id, tags, [error] * len(tags))
