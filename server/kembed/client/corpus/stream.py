"""The stream driver: spans out over one ``EmbedStream``, rows back in input order.

At most ``in_flight`` spans' worth of texts are taken from the input and not yet written (sent,
waiting for a retry, or answered and waiting for an earlier span), so memory is bounded whatever
the order of the answers.

The requests out at once keep their padded tokens within half of what the server admits
(:class:`~kembed.client.window.Budget`, as the library's ``embed`` does; the budget read again
every second), so a lone run on an idle server is never refused; a request is cut to a quarter of
it. Beside other clients the server may still refuse: then pacing follows its pushback. The
requests on the stream are a window (:class:`Window`),
paced as TCP paces its segments (:mod:`kembed.client.window`, as the library's ``embed`` paces its
parts): it starts at one request and grows by one with each success up to a threshold, then by
one per window's worth of successes, up to ``in_flight``. A refusal
(RESOURCE_EXHAUSTED) halves the threshold, drops the window to one request, and holds every send
for the refusal's ``retry_after_ms``: the server said how long its backlog takes, and the
requests refused together cut the window once. Resending a whole window after each pushback, as
if the server could now take it, would get all but one of them refused again. A request refused
while alone on the stream also halves the texts a request carries
(:class:`RequestSize`): what the server cannot take at once is then its size, not their number.
UNAVAILABLE and DEADLINE_EXCEEDED (a server warming up, draining, or busier than a request's
deadline) back off exponentially. A stream that breaks (a replica going away) is opened again
after the same backoff, and the spans it carried are resent. The server cuts a call still open a
grace after its connection's age (``Info.max_connection_age_grace_ms``): so a stream stops taking
requests after half that grace, its answers are read to its end, and the next stream goes on
(:func:`stream_seconds`), on a new connection once the server has asked for one. Nothing is cut,
sent twice or reported. The run gives up when no row has been written for ``give_up_s``; the rows
written so far stay committed.
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from kembed.client.corpus import CorpusError, FinalError
from kembed.client.corpus.pacing import Pacing
from kembed.client.corpus.reader import Span, ThreadedSpans
from kembed.client.requests import NO_PROMPT, Prompt, decode, direction_of, priority
from kembed.client.window import Budget, RequestSize, Window
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

# Rows appended between commits (an fsync each): a crash re-embeds at most this many.
COMMIT_ROWS = 1024
# Per-request errors worth sending again; any other fails the run, naming the rows.
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
MIN_STREAM_S = 1.0  # the shortest life of a stream, whatever the server's grace


def stream_seconds(info: pb.InfoResponse) -> float | None:
    """How long a stream takes requests: half the grace the server gives a call after its
    connection's age (None: the server does not say). A GOAWAY may come just after a stream opens,
    so only a stream younger than the grace is never cut; the other half is for its answers."""
    grace_ms = info.max_connection_age_grace_ms
    return max(MIN_STREAM_S, grace_ms / 2000) if grace_ms else None


@dataclass(frozen=True)
class Request:
    """What every request of a run carries besides its texts."""

    dimensions: int
    truncate: bool
    priority: str = "batch"  # a label of PRIORITIES
    chunk: bool | None = None  # None: the server's default
    prompt: Prompt = NO_PROMPT
    truncation_direction: str = "right"  # or "left": truncate keeps a text's end

    @property
    def truncate_left(self) -> bool:
        return self.truncate and self.truncation_direction.lower() == "left"


def embed_request(span: Span, request: Request) -> pb.EmbedRequest:
    """The one place a run's request is built."""
    return pb.EmbedRequest(
        texts=span.sent,
        dimensions=request.dimensions,
        truncate=request.truncate,
        request_id=str(span.first),
        priority=priority(request.priority),
        chunk=request.chunk,
        prompt_name=request.prompt.name,
        prompt=request.prompt.text,
        input_type=request.prompt.input_type,
        truncation_direction=direction_of(request.truncation_direction),
    )


class InOrder:
    """Answers arrive in any order; rows leave in input order."""

    def __init__(self, next_row: int) -> None:
        self.next_row = next_row
        self._waiting: dict[int, np.ndarray] = {}

    def add(self, first: int, vectors: np.ndarray) -> list[np.ndarray]:
        """Take the rows of the span starting at ``first``; return those now due, in order."""
        self._waiting[first] = vectors
        due = []
        while (rows := self._waiting.pop(self.next_row, None)) is not None:
            due.append(rows)
            self.next_row += len(rows)
        return due


class StreamBroke(Exception):
    """The stream ended without an error status while work was still on it."""


class Sink(Protocol):
    """Where rows go, in input order: an output's writer (or the check's probe)."""

    rows: int  # committed: the first row written goes after them

    def append(self, vectors: np.ndarray) -> None: ...

    def commit(self) -> None: ...


class Progress(Protocol):
    """What the driver reports to: rows written, and notes (reconnects)."""

    def update(self, rows: int) -> None: ...

    def note(self, message: str) -> None: ...


@dataclass
class Counts:
    """How the server answered: a run's drivers share one."""

    retries: int = 0  # requests answered with an error and sent again (refusals among them)
    refusals: int = 0
    reconnects: int = 0


@dataclass
class Flight:
    """A span on one stream: taken from the queue, then written; until answered."""

    span: Span
    epoch: int = -1  # the window's, when written (-1: not yet)
    alone: bool = False  # written while nothing else was on the stream
    cost: int = 0  # its padded tokens in the budget, once written


class OnWire:
    """One stream's flights, by request id, and how many of them are written."""

    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}
        self.written = 0
        self.answered = asyncio.Event()  # set at each answer: the window may have room
        self.closed = False  # its writing is done: it ends once every request on it is answered

    def hold(self, span: Span) -> Flight:
        flight = Flight(span)
        self._flights[str(span.first)] = flight  # from here a broken stream hands it back
        return flight

    def release(self, flight: Flight) -> None:
        """A flight held, not written: it goes on the next stream."""
        del self._flights[str(flight.span.first)]

    def wrote(self, flight: Flight, epoch: int) -> None:
        flight.epoch, flight.alone = epoch, self.written == 0
        self.written += 1

    def pop(self, request_id: str) -> Flight | None:
        flight = self._flights.pop(request_id, None)
        if flight is not None:
            self.written -= 1
            self.answered.set()
        return flight

    def flights(self) -> list[Flight]:
        return list(self._flights.values())

    def __len__(self) -> int:
        return len(self._flights)


class StreamDriver:
    def __init__(
        self,
        stub: pb_grpc.EmbedderStub,
        writer: Sink,
        request: Request,
        dimensions: int,
        batch_texts: int,
        in_flight: int,
        pacing: Pacing,
        progress: Progress,
        budget: Budget,
        stream_s: float | None = None,
        counts: Counts | None = None,
    ) -> None:
        """``budget``: the server's, kept by this run's requests out at once; ``stream_s``: how long
        a stream takes requests (None: for ever)."""
        self._stub = stub
        self._writer = writer
        self._request = request
        self._dimensions = dimensions
        self._pacing = pacing
        self._progress = progress
        self._in_order = InOrder(writer.rows)
        self._size = RequestSize(batch_texts)
        self._window = Window(in_flight)
        self._budget = budget
        self._stream_s = stream_s
        self._most_open = batch_texts * in_flight
        self._open = 0  # texts taken from the input and not yet written
        self._room = asyncio.Event()  # set when texts are written: the input may give more
        self._to_send: asyncio.PriorityQueue[tuple[int, Span | None]] = asyncio.PriorityQueue()
        self._input_done = False
        self._input_error: Exception | None = None
        self._all_written = asyncio.Event()
        self.counts = counts or Counts()
        self.blank = 0  # blank lines written, as rows of zeros

    async def run(self, spans: ThreadedSpans) -> Counts:
        """Embed every span and write its rows; raise CorpusError if the run cannot finish."""
        reader = asyncio.create_task(self._take_input(spans))
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
            self._budget.close()
        if self._input_error is not None:
            raise self._input_error
        return self.counts

    async def _take_input(self, spans: ThreadedSpans) -> None:
        try:
            while True:
                while self._open >= self._most_open:
                    self._room.clear()
                    await self._room.wait()
                span = await spans.next()
                if span is None:
                    break
                self._open += len(span.texts)
                self._to_send.put_nowait((span.first, span))
        except Exception as error:  # from the input thread: a bad line, a read error
            self._input_error = error  # the rows before it are still written, then the run fails
        self._input_done = True
        self._check_all_written()

    def _check_all_written(self) -> None:
        if self._input_done and self._open == 0 and not self._all_written.is_set():
            self._all_written.set()
            self._to_send.put_nowait((sys.maxsize, None))  # tells the sender to close

    async def _stream(self) -> None:
        call = self._stub.EmbedStream()
        on_wire = OnWire()
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
            for flight in on_wire.flights():  # unanswered: sent again on the next stream
                self._budget.settled(flight.cost)
                self._to_send.put_nowait((flight.span.first, flight.span))

    async def _send(self, call: grpc.aio.StreamStreamCall, on_wire: OnWire) -> None:
        """Write the spans as the pacing, the window and the budget allow, until the input is done
        or the stream's time is up; then the stream's writing is done."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + self._stream_s if self._stream_s else math.inf
        while (span := await self._next(ends)) is not None:
            if not span.sent:  # blank lines only: their rows need no server
                self._write(span, np.zeros((len(span.texts), self._dimensions), dtype=np.float32))
                continue
            flight = on_wire.hold(span)
            await self._wait_for_room(on_wire, flight)
            if loop.time() >= ends:  # it goes on the next stream
                on_wire.release(flight)
                self._to_send.put_nowait((flight.span.first, flight.span))
                break
            on_wire.wrote(flight, self._window.epoch)
            self._budget.sent(flight.cost)
            try:
                await call.write(embed_request(flight.span, self._request))
            except asyncio.InvalidStateError:
                raise StreamBroke("the server closed the stream") from None
        on_wire.closed = True
        await call.done_writing()

    async def _next(self, ends: float) -> Span | None:
        """The next span to send, or None: the input is done, or the stream's time is up."""
        try:
            async with asyncio.timeout_at(ends if math.isfinite(ends) else None):
                _, span = await self._to_send.get()
        except TimeoutError:
            return None
        return span

    async def _wait_for_room(self, on_wire: OnWire, flight: Flight) -> None:
        """Until the pushback has passed, the window has room and the budget has room for the
        flight, cut to the size the server takes and to its share of the budget (the rest goes
        next): a refusal meanwhile pauses again."""
        while True:
            self._budget.read_if_due()
            if (wait := self._pacing.wait_s()) > 0:
                await asyncio.sleep(wait)
                continue
            if self._window.admits(on_wire.written):
                flight.cost = self._cut(flight)
                if self._budget.admits(flight.cost):
                    return
            on_wire.answered.clear()
            await on_wire.answered.wait()

    def _cut(self, flight: Flight) -> int:
        """The flight's span cut to what one request carries now (the rest goes next); its cost."""
        span = flight.span
        texts = min(self._size.texts, self._budget.fitting(span.texts))
        if len(span.texts) > texts:
            flight.span, rest = span.split(texts)
            self._to_send.put_nowait((rest.first, rest))
        return self._budget.cost(flight.span.texts)

    async def _receive(self, call: grpc.aio.StreamStreamCall, on_wire: OnWire) -> None:
        while (response := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            assert isinstance(response, pb.EmbedResponse)
            flight = on_wire.pop(response.request_id)
            if flight is None:
                raise CorpusError(f"the server answered request_id {response.request_id!r}, which is not on the stream")
            self._budget.settled(flight.cost)
            self._answered(flight, response)
        if len(on_wire) or not on_wire.closed:
            raise StreamBroke(f"the server ended the stream with {len(on_wire)} requests unanswered")

    def _answered(self, flight: Flight, response: pb.EmbedResponse) -> None:
        span = flight.span
        if response.HasField("error"):
            return self._refused(flight, response.error)
        vectors = decode(response)
        if vectors.shape != (len(span.sent), self._dimensions):
            raise CorpusError(f"{span.lines}: the server answered {vectors.shape[0]} x {vectors.shape[1]} rows")
        self._pacing.progressed()
        self._budget.answered(span.sent, response.token_counts)
        self._window.succeeded()
        self._size.succeeded(len(span.texts))
        self._write(span, span.rows(vectors))

    def _write(self, span: Span, rows: np.ndarray) -> None:
        """The span's rows, written once every span before it is."""
        self.blank += span.blank
        for due in self._in_order.add(span.first, rows):
            self._writer.append(due)
            self._open -= len(due)
            self._progress.update(len(due))
        self._room.set()
        if self._writer.rows + COMMIT_ROWS <= self._in_order.next_row:
            self._writer.commit()
        self._check_all_written()

    def _refused(self, flight: Flight, error: pb.Error) -> None:
        span = flight.span
        code = STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
        why = f"{code.name}: {error.message}"
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._pacing.refused(error.retry_after_ms, why)
            self._window.refused(flight.epoch)
            if flight.alone:
                self._size.refused(len(span.texts))
            self.counts.refusals += 1
        elif code in BACKED_OFF:
            self._pacing.failed(why)
        elif code is grpc.StatusCode.INVALID_ARGUMENT:  # the server refuses these texts: so it will again
            raise FinalError(f"{_where(span, error.message)}: {why}")
        else:
            raise CorpusError(f"{_where(span, error.message)}: {why}")
        self.counts.retries += 1
        self._to_send.put_nowait((span.first, span))


def _where(span: Span, message: str) -> str:
    """The input line a request's error is about (``texts[3]: ...`` names one), else the span's lines."""
    found = re.match(r"texts\[(\d+)\]", message)
    return span.line(span.texts_index(int(found[1]))) if found else span.lines


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)
