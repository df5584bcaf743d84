"""A front end's connection to the engine: requests out, rows back, few frames under load.

``submit`` queues a request and schedules a flush: at once when the last WORK frame carried at
most one request (a lone caller, or one that calls again after its answer, waits for nothing),
else when the frame interval since the last frame ends. Under load, then, every request of an
interval goes out in one WORK frame (with any cancellations and latency samples), and the engine
forms a batch from a frame rather than from each request: per-request costs on both sides
(wake-ups, syscalls, a batch's fixed work) are paid once per frame.

Whatever the interval, a frame also waits until the engine has taken the last one (its
acknowledgement on the board): the frames are clocked by the engine's event loop, so when that loop
is what limits (many front ends feeding one engine) frames grow instead of queueing in the socket,
and the loop's cost per frame is spread over more requests (docs/decisions/frame-interval.md).

:class:`EngineLink` holds the socket and the pacing; the state is in the pieces it drives:
``outbox.NextFrame`` (what the next WORK frame carries), ``outbox.InTransit`` (padded tokens the
engine's published backlog may not count yet, which the pre-screen reads) and ``inbox.Waiting``
(requests waiting for their rows).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from pathlib import Path

from kembed.domain.inputs import Sequences
from kembed.frontend.inbox import Pending, Waiting
from kembed.frontend.outbox import InTransit, NextFrame
from kembed.ipc.protocol import (
    PROTOCOL_VERSION,
    Errors,
    Hello,
    LinkClosed,
    ProtocolError,
    Ready,
    Result,
    ServingInfo,
    check_version,
    receive,
    send,
)
from kembed.plumbing import request_log
from kembed.plumbing.runtime import ENGINE_SOCKET
from kembed.policy.priority import Priority

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # the engine binds its socket after importing torch: seconds, not minutes
CONNECT_RETRY_S = 0.05
SAMPLE_FLUSH_S = 0.01  # well under the P95 cache (50 ms) and the engine's board refresh (100 ms)
TAKEN_POLL_S = 0.0002  # a frame held for the engine to take the last looks again this often


class EngineLink:
    """The socket to the engine, and when frames go on it."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        info: ServingInfo,
        frame_interval: float,
        frames_taken: Callable[[], int],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.info = info
        self.in_transit = InTransit(frames_taken)
        self._next = NextFrame()
        self._waiting = Waiting(info.dimensions)
        self._tags = itertools.count(1)
        self._frame_interval = frame_interval
        self._last_flush = 0.0  # loop time; unused until a frame carried several requests
        self._last_frame_requests = 0  # requests the last WORK frame carried
        self._flush_at: asyncio.TimerHandle | None = None  # a later flush, for samples alone
        self._flush_now: asyncio.Handle | None = None  # the flush of queued requests

    @classmethod
    async def connect(
        cls, runtime: Path, index: int, frame_interval: float, frames_taken: Callable[[], int]
    ) -> EngineLink:
        """Connect (retrying while the engine starts), say hello, and wait for READY. Once calls
        overlap, WORK frames go at most one per ``frame_interval`` seconds; each once the engine
        has taken the WORK frames before it, by ``frames_taken``."""
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
        return cls(reader, writer, ready.info, frame_interval, frames_taken)

    def submit(
        self, seqs: Sequences, cost: int, arrival: float, deadline: float, priority: Priority
    ) -> tuple[int, Pending]:
        """Queue a request admitted at ``cost`` padded tokens (the engine's final word counts the same)."""
        tag = next(self._tags)
        future = asyncio.get_running_loop().create_future()
        pending = Pending(future, arrival, seqs.count, self.info.dimensions, priority)
        self._waiting.add(tag, pending)
        self._next.add(tag, seqs, cost, deadline, priority, request_log.request_id.get())  # for the engine's log
        self.in_transit.queued(cost, priority)
        self._schedule_flush()
        return tag, pending

    def cancel(self, tag: int) -> None:
        """Nobody waits for this request any more: dropped here if its frame has not gone, else the
        engine drops what it still holds of it."""
        if not self._waiting.discard(tag):
            return
        if (dropped := self._next.cancel(tag)) is None:
            self._schedule_flush()
        else:  # never sent: the engine need not hear of it
            self.in_transit.withdrawn(*dropped)

    def add_latency(self, seconds: float, priority: Priority) -> None:
        """A served request's latency, for the engine's P95 windows of the class (which every front
        end shares)."""
        self._next.add_latency(seconds, priority)
        self._schedule_samples()

    def add_refusal(self, spared_seconds: float, priority: Priority) -> None:
        """A refusal, at the wait it spared, for the window shedding acts on."""
        self._next.add_refusal(spared_seconds, priority)
        self._schedule_samples()

    def _schedule_samples(self) -> None:
        """Samples alone wait up to SAMPLE_FLUSH_S for a frame: a storm of rejections must not
        become a storm of frames that wake the engine between batches."""
        if self._flush_now is None and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(SAMPLE_FLUSH_S, self._flush)

    async def run(self) -> None:
        """Route the engine's answers until the link closes (raises :class:`LinkClosed`), or until
        something arrives that is not an answer (raises :class:`ProtocolError`)."""
        while True:
            message = await receive(self._reader)
            if isinstance(message, Result):
                self._waiting.scatter(message)
            elif isinstance(message, Errors):
                self._waiting.fail(message)
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
        if self._writer.is_closing() or not self._next:  # closed, or all that was queued withdrawn
            return
        loop = asyncio.get_running_loop()
        if self.in_transit.engine_behind():  # the engine's loop is behind: gather more
            self._flush_now = loop.call_later(TAKEN_POLL_S, self._flush)
            return
        self._last_flush = loop.time()
        self._last_frame_requests = self._next.requests
        send(self._writer, self._next.take())
        self.in_transit.frame_sent()
