"""A front end's connection to the engine: requests out, rows back, few frames under load.

``submit`` queues a request and schedules a flush: at once when the last WORK frame carried at
most one request (a lone caller, or one that calls again after its answer, waits for nothing),
else when the frame interval since the last frame ends. Under load, then, every request of an
interval goes out in one WORK frame (with any cancellations and latency samples), and the engine
forms a batch from a frame rather than from each request: per-request costs on both sides
(wake-ups, syscalls, a batch's fixed work) are paid once per frame. RESULT frames scatter rows
into each waiting request by (tag, slot).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from kembed.inputs import Sequences
from kembed.priority import Priority
from kembed.protocol import (
    PROTOCOL_VERSION,
    Errors,
    Hello,
    LinkClosed,
    ProtocolError,
    Ready,
    Result,
    ServingInfo,
    Work,
    check_version,
    receive,
    send,
)
from kembed.runtime import ENGINE_SOCKET

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # the engine binds its socket after importing torch: seconds, not minutes
CONNECT_RETRY_S = 0.05
SAMPLE_FLUSH_S = 0.01  # well under the P95 cache (50 ms) and the engine's board refresh (100 ms)


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


class EngineLink:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: ServingInfo, frame_interval: float
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.info = info
        self._tags = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._out_tags: list[int] = []
        self._out_deadlines: list[float] = []
        self._out_costs: list[int] = []
        self._out_priorities: list[int] = []
        self._out_lengths: list[np.ndarray] = []
        self._out_ids: list[np.ndarray] = []
        self._out_cancels: list[int] = []
        self._out_latencies: list[float] = []
        self._out_sample_priorities: list[int] = []
        self._frame_interval = frame_interval
        self._last_flush = 0.0  # loop time; unused until a frame carried several requests
        self._last_frame_requests = 0  # requests the last WORK frame carried
        self._flush_at: asyncio.TimerHandle | None = None  # a later flush, for samples alone
        self._flush_now: asyncio.Handle | None = None  # the flush of queued requests
        self._frames_sent = 0
        self._out_tokens = [0] * len(Priority)  # padded tokens queued for the next frame, by class
        self._sent_tokens: deque[tuple[int, list[int]]] = deque()  # (frame number, tokens by class)
        self._untaken = [0] * len(Priority)  # padded tokens in frames the engine has not taken, by class

    @classmethod
    async def connect(cls, runtime: Path, index: int, frame_interval: float) -> EngineLink:
        """Connect (retrying while the engine starts), say hello, and wait for READY. Once calls
        overlap, WORK frames go at most one per ``frame_interval`` seconds."""
        path = str(runtime / ENGINE_SOCKET)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + CONNECT_TIMEOUT_S
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > give_up:
                    raise LinkClosed(f"no engine at {path}") from None
                await asyncio.sleep(CONNECT_RETRY_S)
        send(writer, Hello(PROTOCOL_VERSION, index))
        ready = await receive(reader)
        if not isinstance(ready, Ready):
            raise ProtocolError(f"expected READY from the engine, got {ready.kind.name}")
        check_version(ready.version)
        return cls(reader, writer, ready.info, frame_interval)

    def submit(
        self, seqs: Sequences, cost: int, arrival: float, deadline: float, priority: Priority
    ) -> tuple[int, Pending]:
        """Queue a request admitted at ``cost`` padded tokens (the engine's final word counts the same)."""
        tag = next(self._tags)
        future = asyncio.get_running_loop().create_future()
        pending = Pending(future, arrival, seqs.count, self.info.dimensions, priority)
        self._pending[tag] = pending
        self._out_tags.append(tag)
        self._out_deadlines.append(deadline)
        self._out_costs.append(cost)
        self._out_priorities.append(priority)
        self._out_lengths.append(seqs.lengths)
        self._out_ids.append(seqs.ids)
        self._out_tokens[priority] += cost
        self._schedule_flush()
        return tag, pending

    def unconfirmed(self, frames_taken: int) -> list[int]:
        """Padded tokens by class of requests submitted here that the engine's published backlog may
        not count yet: queued for the next frame, or in frames past the ``frames_taken`` it has
        acknowledged. Admission weighs them too: a burst read in one loop turn would otherwise be
        admitted, request after request, against a board that has not seen any of it."""
        while self._sent_tokens and self._sent_tokens[0][0] <= frames_taken:
            for priority, tokens in enumerate(self._sent_tokens.popleft()[1]):
                self._untaken[priority] -= tokens
        return [sent + queued for sent, queued in zip(self._untaken, self._out_tokens, strict=True)]

    def cancel(self, tag: int) -> None:
        """Nobody waits for this request any more: the engine drops what is still queued."""
        if self._pending.pop(tag, None) is not None:
            self._out_cancels.append(tag)
            self._schedule_flush()

    def add_latency(self, seconds: float, priority: Priority) -> None:
        """A sample for the engine's P95 window of the class (which every front end shares). Samples
        alone wait up to SAMPLE_FLUSH_S for a frame: a storm of rejections must not become a storm
        of frames that wake the engine between batches."""
        self._out_latencies.append(seconds)
        self._out_sample_priorities.append(priority)
        if self._flush_now is None and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(SAMPLE_FLUSH_S, self._flush)

    async def run(self) -> None:
        """Route the engine's answers until the link closes (raises :class:`LinkClosed`), or until
        something arrives that is not an answer (raises :class:`ProtocolError`)."""
        while True:
            message = await receive(self._reader)
            if isinstance(message, Result):
                self._scatter(message)
            elif isinstance(message, Errors):
                self._fail(message)
            else:
                raise ProtocolError(f"unexpected {message.kind.name} from the engine")

    def close(self) -> None:
        self._writer.close()

    def _schedule_flush(self) -> None:
        if self._flush_now is None:
            loop = asyncio.get_running_loop()
            # Several requests in the last frame mean calls overlap: worth an interval's wait.
            paced = self._last_flush + self._frame_interval if self._last_frame_requests > 1 else 0.0
            self._flush_now = loop.call_at(max(loop.time(), paced), self._flush)

    def _flush(self) -> None:
        for handle in (self._flush_now, self._flush_at):
            if handle is not None:
                handle.cancel()
        self._flush_now = self._flush_at = None
        self._last_flush = asyncio.get_running_loop().time()
        self._last_frame_requests = len(self._out_tags)
        if self._writer.is_closing():
            return
        work = Work(
            tags=np.asarray(self._out_tags, dtype="<u8"),
            deadlines=np.asarray(self._out_deadlines, dtype="<f8"),
            counts=np.fromiter(map(len, self._out_lengths), dtype="<u4", count=len(self._out_lengths)),
            costs=np.asarray(self._out_costs, dtype="<u8"),
            priorities=np.asarray(self._out_priorities, dtype="u1"),
            lengths=_concat(self._out_lengths),
            ids=_concat(self._out_ids),
            cancels=np.asarray(self._out_cancels, dtype="<u8"),
            latencies=np.asarray(self._out_latencies, dtype="<f8"),
            sample_priorities=np.asarray(self._out_sample_priorities, dtype="u1"),
        )
        send(self._writer, work)
        self._frames_sent += 1
        if any(self._out_tokens):
            self._sent_tokens.append((self._frames_sent, self._out_tokens))
            self._untaken = [sent + queued for sent, queued in zip(self._untaken, self._out_tokens, strict=True)]
            self._out_tokens = [0] * len(Priority)
        for buffer in self._outbox():
            buffer.clear()

    def _outbox(self) -> tuple[list[Any], ...]:
        """Everything queued for the next WORK frame."""
        return (
            self._out_tags,
            self._out_deadlines,
            self._out_costs,
            self._out_priorities,
            self._out_lengths,
            self._out_ids,
            self._out_cancels,
            self._out_latencies,
            self._out_sample_priorities,
        )

    def _scatter(self, result: Result) -> None:
        tags, slots, rows = result.tags, result.slots, result.rows
        if rows.shape[1] != self.info.dimensions:
            raise ProtocolError(f"RESULT: rows of {rows.shape[1]} dimensions, the model has {self.info.dimensions}")
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

    def _fail(self, failed: Errors) -> None:
        for tag, error in zip(failed.tags, failed.errors, strict=True):
            pending = self._pending.pop(tag, None)
            if pending is not None and not pending.future.done():
                pending.future.set_exception(error)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype("<i4", copy=False) if arrays else np.empty(0, dtype="<i4")
