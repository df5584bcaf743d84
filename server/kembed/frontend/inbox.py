"""What a front end gets back from the engine: RESULT rows scattered into the requests waiting for
them, by (tag, slot), and ERRORS failing them."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from kembed.priority import Priority
from kembed.protocol import Errors, ProtocolError, Result


class Pending:
    """One request waiting for its rows."""

    __slots__ = ("arrival", "embeddings", "future", "inference_s", "last_start", "priority", "remaining")

    def __init__(
        self, future: asyncio.Future[None], arrival: float, count: int, dimensions: int, priority: Priority
    ) -> None:
        self.future = future
        self.arrival = arrival
        self.priority = priority
        self.embeddings = np.empty((count, dimensions), dtype=np.float32)
        self.remaining = count
        self.inference_s = 0.0  # compute time of the batches its items ran in
        self.last_start = 0.0  # when the batch holding its last item started


class Waiting:
    """Requests waiting for their rows, by tag: RESULT rows scatter into them, ERRORS fail them."""

    def __init__(self, dimensions: int) -> None:
        self._dimensions = dimensions
        self._pending: dict[int, Pending] = {}

    def add(self, tag: int, pending: Pending) -> None:
        self._pending[tag] = pending

    def discard(self, tag: int) -> bool:
        """Stop waiting for ``tag``; whether it was still waited for."""
        return self._pending.pop(tag, None) is not None

    def scatter(self, result: Result) -> None:
        tags, slots, rows = result.tags, result.slots, result.rows
        if rows.shape[1] != self._dimensions:
            raise ProtocolError(f"RESULT: rows of {rows.shape[1]} dimensions, the model has {self._dimensions}")
        # A request's rows in one batch are contiguous: one step per request, none per row.
        bounds = [0, *(np.flatnonzero(np.diff(tags)) + 1).tolist(), len(tags)]
        for begin, end in itertools.pairwise(bounds):
            pending = self._pending.get(int(tags[begin]))
            if pending is None:
                continue  # timed out or cancelled meanwhile
            if int(slots[begin:end].max()) >= len(pending.embeddings) or end - begin > pending.remaining:
                raise ProtocolError(f"RESULT: slots beyond a request of {len(pending.embeddings)} items")
            pending.embeddings[slots[begin:end]] = rows[begin:end]
            pending.remaining -= end - begin
            pending.inference_s += result.seconds
            pending.last_start = max(pending.last_start, result.started)
            if pending.remaining == 0:
                del self._pending[int(tags[begin])]
                if not pending.future.done():  # cancelled by its caller meanwhile
                    pending.future.set_result(None)

    def fail(self, failed: Errors) -> None:
        for tag, error in zip(failed.tags, failed.errors, strict=True):
            pending = self._pending.pop(tag, None)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(error)
