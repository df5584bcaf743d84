"""What a front end gets back from the engine: RESULT rows scattered into the requests waiting for
them, by (tag, slot), and ERRORS failing them."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from kembed.ipc.protocol import Errors, ProtocolError, Result
from kembed.policy.priority import Priority


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
        rows = result.rows
        if rows.shape[1] != self._dimensions:
            raise ProtocolError(f"RESULT: rows of {rows.shape[1]} dimensions, the model has {self._dimensions}")
        # A request's rows in one batch are contiguous: one step per request, none per row. The tags
        # and slots as lists: a frame holds a few requests, where numpy's calls cost more than Python's.
        slots, begin = result.slots.tolist(), 0
        for tag, run in itertools.groupby(result.tags.tolist()):
            end = begin + sum(1 for _ in run)
            pending = self._pending.get(tag)
            if pending is not None:
                self._fill(tag, pending, slots[begin:end], rows[begin:end], result)
            begin = end

    def _fill(self, tag: int, pending: Pending, slots: list[int], rows: np.ndarray, result: Result) -> None:
        """A request's ``rows`` of one batch into its ``slots``."""
        if max(slots) >= len(pending.embeddings) or len(slots) > pending.remaining:
            raise ProtocolError(f"RESULT: slots beyond a request of {len(pending.embeddings)} items")
        if len(slots) == 1:  # one text: an index, not numpy's fancy indexing
            pending.embeddings[slots[0]] = rows[0]
        else:
            pending.embeddings[slots] = rows
        pending.remaining -= len(slots)
        pending.inference_s += result.seconds
        pending.last_start = max(pending.last_start, result.started)
        if pending.remaining == 0:
            del self._pending[tag]
            if not pending.future.done():  # cancelled by its caller meanwhile
                pending.future.set_result(None)

    def fail(self, failed: Errors) -> None:
        for tag, error in zip(failed.tags, failed.errors, strict=True):
            pending = self._pending.pop(tag, None)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(error)
