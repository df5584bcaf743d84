"""The stream driver: batches out over one ``EmbedStream``, rows back in input order.

At most ``in_flight`` batches' worth of texts are taken from the input and not yet written (sent,
waiting for a retry, or answered and waiting for an earlier batch), so memory is bounded whatever
the order of the answers. A refused request (RESOURCE_EXHAUSTED) is resent after its
``retry_after_ms``, and nothing else is sent on the stream meanwhile: the server enforces pushback
per connection, so sending more would only be held or refused. A refusal also halves the texts a
request carries (:class:`RequestSize`): the server refuses a request whose own cost exceeds its
drain budget even when idle, so a fixed size could be refused forever; sizes grow back as
requests succeed. UNAVAILABLE and DEADLINE_EXCEEDED (a server warming
up, draining, or busier than a request's deadline) back off exponentially. A stream that breaks
(a replica going away, the server's connection-age limit) is opened again after the same backoff,
and the batches it carried are resent. The job gives up when no row has been written for
``give_up_s``; the rows written so far stay committed.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np

from kembed.client.corpus import CorpusError
from kembed.client.corpus.reader import Span, ThreadedSpans
from kembed.client.corpus.writers import Writer
from kembed.client.embed_client import decode
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

BACKOFF_S = 0.1
MAX_BACKOFF_S = 10.0
# Rows appended between commits (an fsync each): a crash re-embeds at most this many.
COMMIT_ROWS = 1024
# Per-request errors worth sending again; any other fails the job, naming the rows.
BACKED_OFF = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Stream-level failures after which the stream is opened again.
RECONNECT = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,  # by the server (a drain's end); the driver's own cancels never get here
)
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
# The requests' classes, by the label the command takes: the proto's PRIORITY_* names, lower case.
PRIORITIES = tuple(pb.Priority.Name(value).removeprefix("PRIORITY_").lower() for value in pb.Priority.values())


@dataclass(frozen=True)
class Request:
    """What every request of a job carries besides its texts."""

    dimensions: int
    truncate: bool
    priority: str = "batch"  # a label of PRIORITIES


def embed_request(batch: Span, request: Request) -> pb.EmbedRequest:
    """The one place a job's request is built."""
    return pb.EmbedRequest(
        texts=batch.texts,
        dimensions=request.dimensions,
        truncate=request.truncate,
        request_id=str(batch.first),
        priority=f"PRIORITY_{request.priority.upper()}",  # the proto's enum, by name
    )


@dataclass
class Pacing:
    """When the stream may send again, and when to give up. Pure: the clock and jitter are injected."""

    give_up_s: float
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = field(default=lambda: random.uniform(0.8, 1.2))
    paused_until: float = 0.0
    failures: int = 0  # in a row, for the backoff
    last_progress: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_progress = self.clock()

    def wait_s(self) -> float:
        return max(0.0, self.paused_until - self.clock())

    def progressed(self) -> None:
        self.failures = 0
        self.last_progress = self.clock()

    def refused(self, retry_after_ms: int, why: str) -> None:
        """RESOURCE_EXHAUSTED: the server says when (already jittered); without a time, back off."""
        if not retry_after_ms:
            return self.failed(why)
        self._pause(retry_after_ms / 1000, why)

    def failed(self, why: str) -> None:
        self.failures += 1
        self._pause(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (self.failures - 1)) * self.jitter(), why)

    def _pause(self, seconds: float, why: str) -> None:
        now = self.clock()
        if now - self.last_progress > self.give_up_s:
            idle = now - self.last_progress
            raise CorpusError(f"gave up: no row written for {idle:.0f} s (--give-up-after); last: {why}")
        self.paused_until = max(self.paused_until, now + seconds)


class RequestSize:
    """How many texts the next request carries, at most ``largest`` (``--batch-texts``)."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.texts = largest

    def refused(self, texts: int) -> None:
        """Half of the refused request's size: requests refused together shrink it once, not each."""
        self.texts = min(self.texts, max(1, texts // 2))

    def succeeded(self, texts: int) -> None:
        if texts >= self.texts:
            self.texts = min(self.largest, self.texts + max(1, self.texts // 4))


class InOrder:
    """Answers arrive in any order; rows leave in input order."""

    def __init__(self, next_row: int) -> None:
        self.next_row = next_row
        self._waiting: dict[int, np.ndarray] = {}

    def add(self, first: int, vectors: np.ndarray) -> list[np.ndarray]:
        """Take the rows of the batch starting at ``first``; return those now due, in order."""
        self._waiting[first] = vectors
        due = []
        while (rows := self._waiting.pop(self.next_row, None)) is not None:
            due.append(rows)
            self.next_row += len(rows)
        return due


class StreamBroke(Exception):
    """The stream ended without an error status while work was still on it."""


class Progress(Protocol):
    """What the driver reports to: rows written, and notes (reconnects)."""

    def update(self, rows: int) -> None: ...

    def note(self, message: str) -> None: ...


@dataclass
class Counts:
    embedded: int = 0
    retries: int = 0
    reconnects: int = 0


class StreamDriver:
    def __init__(
        self,
        stub: pb_grpc.EmbedderStub,
        writer: Writer,
        request: Request,
        dimensions: int,
        batch_texts: int,
        in_flight: int,
        pacing: Pacing,
        progress: Progress,
    ) -> None:
        self._stub = stub
        self._writer = writer
        self._request = request
        self._dimensions = dimensions
        self._pacing = pacing
        self._progress = progress
        self._in_order = InOrder(writer.rows)
        self._size = RequestSize(batch_texts)
        self._window = batch_texts * in_flight
        self._open = 0  # texts taken from the input and not yet written
        self._room = asyncio.Event()  # set when texts are written: the window may take more
        self._to_send: asyncio.PriorityQueue[tuple[int, Span | None]] = asyncio.PriorityQueue()
        self._input_done = False
        self._input_error: Exception | None = None
        self._all_written = asyncio.Event()
        self.counts = Counts()

    async def run(self, batches: ThreadedSpans) -> Counts:
        """Embed every batch and write its rows; raise CorpusError if the job cannot finish."""
        reader = asyncio.create_task(self._take_input(batches))
        try:
            while not self._all_written.is_set():
                try:
                    await self._stream()
                except (grpc.aio.AioRpcError, StreamBroke) as error:
                    why = _describe(error)
                    if isinstance(error, grpc.aio.AioRpcError) and error.code() not in RECONNECT:
                        raise CorpusError(f"the stream failed: {why}") from None
                    self._pacing.failed(why)
                    self.counts.reconnects += 1
                    self._progress.note(f"stream broke ({why}): opening it again in {self._pacing.wait_s():.1f} s")
                    await asyncio.sleep(self._pacing.wait_s())
        finally:
            reader.cancel()
        if self._input_error is not None:
            raise self._input_error
        return self.counts

    async def _take_input(self, batches: ThreadedSpans) -> None:
        try:
            while True:
                while self._open >= self._window:
                    self._room.clear()
                    await self._room.wait()
                batch = await batches.next()
                if batch is None:
                    break
                self._open += len(batch.texts)
                self._to_send.put_nowait((batch.first, batch))
        except Exception as error:  # from the input thread: a bad line, a read error
            self._input_error = error  # the rows before it are still written, then the job fails
        self._input_done = True
        self._check_all_written()

    def _check_all_written(self) -> None:
        if self._input_done and self._open == 0 and not self._all_written.is_set():
            self._all_written.set()
            self._to_send.put_nowait((sys.maxsize, None))  # tells the sender to close

    async def _stream(self) -> None:
        call = self._stub.EmbedStream()
        on_wire: dict[str, Span] = {}
        sender = asyncio.create_task(self._send(call, on_wire))
        receiver = asyncio.create_task(self._receive(call, on_wire))
        try:
            await asyncio.wait((sender, receiver), return_when=asyncio.FIRST_EXCEPTION)
            ended = [task.exception() for task in (receiver, sender) if task.done()]  # each one retrieved
            for error in ended:
                if error is not None:
                    raise error
        finally:
            sender.cancel()
            receiver.cancel()
            call.cancel()
            for batch in on_wire.values():  # unanswered: sent again on the next stream
                self._to_send.put_nowait((batch.first, batch))

    async def _send(self, call: grpc.aio.StreamStreamCall, on_wire: dict[str, Span]) -> None:
        while True:
            _, batch = await self._to_send.get()
            if batch is None:
                await call.done_writing()
                return
            on_wire[str(batch.first)] = batch  # from here a broken stream hands it back
            while (wait := self._pacing.wait_s()) > 0:  # noqa: ASYNC110 (a refusal meanwhile may extend the pause)
                await asyncio.sleep(wait)
            if len(batch.texts) > self._size.texts:  # cut to the current size; the rest goes next
                del on_wire[str(batch.first)]
                batch, rest = batch.split(self._size.texts)
                on_wire[str(batch.first)] = batch
                self._to_send.put_nowait((rest.first, rest))
            try:
                await call.write(embed_request(batch, self._request))
            except asyncio.InvalidStateError:
                raise StreamBroke("the server closed the stream") from None

    async def _receive(self, call: grpc.aio.StreamStreamCall, on_wire: dict[str, Span]) -> None:
        while (response := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            assert isinstance(response, pb.EmbedResponse)
            batch = on_wire.pop(response.request_id, None)
            if batch is None:
                raise CorpusError(f"the server answered request_id {response.request_id!r}, which is not on the stream")
            self._answered(batch, response)
        if not self._all_written.is_set():
            raise StreamBroke(f"the server ended the stream with {len(on_wire)} requests unanswered")

    def _answered(self, batch: Span, response: pb.EmbedResponse) -> None:
        if response.HasField("error"):
            return self._refused(batch, response.error)
        vectors = decode(response)
        if vectors.shape != (len(batch.texts), self._dimensions):
            raise CorpusError(f"{batch.lines}: the server answered {vectors.shape[0]} x {vectors.shape[1]} rows")
        for rows in self._in_order.add(batch.first, vectors):
            self._writer.append(rows)
            self._open -= len(rows)
            self.counts.embedded += len(rows)
            self._progress.update(len(rows))
        self._room.set()
        self._pacing.progressed()
        self._size.succeeded(len(batch.texts))
        if self._writer.rows + COMMIT_ROWS <= self._in_order.next_row:
            self._writer.commit()
        self._check_all_written()

    def _refused(self, batch: Span, error: pb.Error) -> None:
        code = STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
        why = f"{code.name}: {error.message}"
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._pacing.refused(error.retry_after_ms, why)
            self._size.refused(len(batch.texts))
        elif code in BACKED_OFF:
            self._pacing.failed(why)
        else:
            raise CorpusError(f"{_where(batch, error.message)}: {why}")
        self.counts.retries += 1
        self._to_send.put_nowait((batch.first, batch))


def _where(batch: Span, message: str) -> str:
    """The input line a request's error is about (``texts[3]: ...`` names one), else the batch's lines."""
    found = re.match(r"texts\[(\d+)\]", message)
    return f"input line {batch.first + int(found[1]) + 1}" if found else batch.lines


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)
