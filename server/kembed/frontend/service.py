"""The gRPC edge of a front end: validate → pre-screen → tokenize → admit → engine → respond.

Every failure becomes a gRPC status whose message names the field or the reason: bad input is
INVALID_ARGUMENT before it can reach a shared batch; admission rejections are RESOURCE_EXHAUSTED
with a ``grpc-retry-pushback-ms`` trailer; warming up or draining is UNAVAILABLE; work whose
deadline passed is dropped before compute and answered DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Protocol

import grpc
import numpy as np
import tokenizers

from kembed import __version__
from kembed.admission import Rejection
from kembed.config import Settings
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.engine.buckets import padded_lengths
from kembed.frontend.errors import EmbedError
from kembed.frontend.link import EngineLink, Pending
from kembed.frontend.pushback import ConnectionPushback, HeldCalls
from kembed.frontend.screen import Screen
from kembed.inputs import InputError, Sequences, Tokenizer
from kembed.metrics import FrontendMetrics
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
# What one EmbedStream may hold, from reading a request until its answer is written: requests,
# and answer rows (6 MiB of float32 at 384 dimensions). Past either, the stream stops reading.
MAX_STREAM_REQUESTS = 256
MAX_STREAM_ROWS = 4096
# Inputs up to this many characters or id bytes are tokenized on the event loop: a trip through the
# executor (two thread switches and a loop wake-up) costs more than tokenizing a sentence. Larger
# inputs go to the executor, where the Rust tokenizer runs without the GIL.
INLINE_PREPARE_LIMIT = 2048
# Counting words for the pre-screen costs a fiftieth of tokenizing; above this many characters a
# request's words are not counted on the event loop, and it is pre-screened at one token an item.
WORD_COUNT_LIMIT = 65536


def _input_size(request: pb.EmbedRequest) -> int:
    """Characters of text, or bytes of ids: what tokenizing or checking the request costs."""
    if request.HasField("tokens"):
        return len(request.tokens.ids)
    return sum(len(text) for text in request.texts)


def _item_count(request: pb.EmbedRequest) -> int:
    return len(request.tokens.lengths) if request.HasField("tokens") else len(request.texts)


class Gate:
    """Whether requests are still taken, and how many are in progress, so a drain knows when
    everything accepted has been answered. Closed when this front end drains, or as soon as the
    supervisor marks the whole pod draining (a front end may see its SIGTERM a moment later)."""

    def __init__(self, pod_draining: Callable[[], bool]) -> None:
        self._pod_draining = pod_draining
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.check_open()
        self.hold()

    def check_open(self) -> None:
        if self.draining or self._pod_draining():
            raise EmbedError(grpc.StatusCode.UNAVAILABLE, "server is draining: retry on another replica")

    def hold(self) -> None:
        """Count work in progress whether or not the gate is open: a computed answer still to write."""
        self.active += 1
        self._idle.clear()

    def leave(self, count: int = 1) -> None:
        self.active -= count
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.active:  # again: a stream may hold an answer before this waiter runs
            await self._idle.wait()


class StreamWindow:
    """What one EmbedStream holds, from reading a request until its answer is written: at most
    ``requests`` requests and ``rows`` answer rows (a larger request goes alone). A client that
    stops reading fills it, and the stream stops reading its requests, so gRPC's flow control
    stops the client."""

    def __init__(self, requests: int = MAX_STREAM_REQUESTS, rows: int = MAX_STREAM_ROWS) -> None:
        self._max_requests = requests
        self._max_rows = rows
        self._requests = 0
        self._rows = 0
        self._room = asyncio.Event()

    async def take(self, rows: int) -> None:
        """Wait for room for a request of ``rows``, and hold it."""
        while self._requests and (self._requests >= self._max_requests or self._rows + rows > self._max_rows):
            self._room.clear()
            await self._room.wait()
        self._requests += 1
        self._rows += rows

    def give_back(self, rows: int) -> None:
        """A request's answer was written."""
        self._requests -= 1
        self._rows -= rows
        self._room.set()


class Service(Protocol):
    """What the RPCs call: the real path once the engine is warm, a refusal before."""

    async def embed(
        self, request: pb.EmbedRequest, time_remaining: float | None, connection: str
    ) -> pb.EmbedResponse: ...

    def info(self) -> pb.InfoResponse: ...


class WarmingUp:
    """The service until the engine is warm: every call is UNAVAILABLE."""

    async def embed(self, request: pb.EmbedRequest, time_remaining: float | None, connection: str) -> pb.EmbedResponse:
        raise EmbedError(grpc.StatusCode.UNAVAILABLE, "server is warming up: retry shortly")

    def info(self) -> pb.InfoResponse:
        raise EmbedError(grpc.StatusCode.UNAVAILABLE, "server is warming up: retry shortly")


class EmbedService:
    """One request's path, independent of the RPC shape (unary or stream)."""

    def __init__(
        self,
        settings: Settings,
        link: EngineLink,
        screen: Screen,
        gate: Gate,
        metrics: FrontendMetrics,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        info = link.info
        self._settings = settings
        self._info = info
        self._link = link
        self._screen = screen
        self._gate = gate
        self._metrics = metrics
        self._executor = executor
        self._clock = clock
        self._ladder = np.asarray(info.bucket_lengths)
        self._pushback = ConnectionPushback(clock)
        self._held = HeldCalls(self._pushback, screen.has_room)
        self._tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_str(info.tokenizer_json),
            pad_token_id=info.pad_token_id,
            max_input_tokens=info.max_input_tokens,
            vocab_size=info.vocab_size,
            max_items=settings.max_items_per_request,
            max_text_chars=settings.max_text_chars,
        )

    async def embed(self, request: pb.EmbedRequest, time_remaining: float | None, connection: str) -> pb.EmbedResponse:
        """``connection`` names the client's connection: its pushback is enforced on it."""
        arrival = self._clock()
        budget = self._settings.default_timeout_ms / 1000 if time_remaining is None else time_remaining
        self._gate.enter()
        try:
            return await self._embed(request, arrival, arrival + budget, connection)
        except EmbedError as error:
            if error.retry_after_ms:
                self._pushback.refused(connection, error.retry_after_ms)
            raise
        finally:
            self._gate.leave()

    def release_held(self) -> None:
        """Draining: calls held for their connection's pushback go on (to be refused), none waits any more."""
        self._held.release_all()

    async def _embed(
        self, request: pb.EmbedRequest, arrival: float, deadline: float, connection: str
    ) -> pb.EmbedResponse:
        self._validate(request)
        least_cost = self._least_cost(request)
        if self._pushback.must_wait(connection):
            self._metrics.pushback_waits.inc()
            await self._held.wait(connection, least_cost)
            # Then handled as if it had just arrived: its wait was its client's own doing.
            self._gate.check_open()
            arrival = self._clock()
        self._raise_if_rejected(self._screen.before_tokenizing(least_cost))
        try:
            if _input_size(request) <= INLINE_PREPARE_LIMIT:
                seqs = self._tokenize(request)
            else:
                seqs = await asyncio.get_running_loop().run_in_executor(self._executor, self._tokenize, request)
        except InputError as error:
            raise EmbedError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        tokenized = self._clock()
        cost = self._padded_tokens(seqs.lengths)
        self._admit(cost)
        tag, pending = self._link.submit(seqs, cost, arrival, deadline)
        await self._wait(tag, pending, deadline)
        done = self._clock()
        self._link.add_latency(done - arrival)
        self._metrics.request_duration.observe(done - arrival)
        return self._response(request, seqs, pending, tokenized - arrival, arrival, done)

    def _validate(self, request: pb.EmbedRequest) -> None:
        has_texts, has_tokens = len(request.texts) > 0, request.HasField("tokens")
        if has_texts == has_tokens:
            raise EmbedError(grpc.StatusCode.INVALID_ARGUMENT, "texts, tokens: exactly one of the two must be set")
        dimensions = self._info.dimensions
        if request.dimensions > dimensions:
            raise EmbedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"dimensions: {request.dimensions} exceeds the model's {dimensions}",
            )
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise EmbedError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters"
            )

    def _tokenize(self, request: pb.EmbedRequest) -> Sequences:
        if request.HasField("tokens"):
            return self._tokenizer.from_token_bytes(request.tokens.ids, request.tokens.lengths, request.truncate)
        return self._tokenizer.from_texts(request.texts, request.truncate)

    def _least_cost(self, request: pb.EmbedRequest) -> int:
        """A lower bound of the request's padded cost, read without tokenizing, so that the
        pre-screen refuses what the server cannot take before it costs a tokenization: exact for
        pre-tokenized ids, from the word counts for texts (see ``Tokenizer.least_lengths``)."""
        items = self._settings.max_items_per_request
        if request.HasField("tokens"):
            lengths = np.asarray(request.tokens.lengths[:items], dtype=np.int64)
            lengths = np.clip(lengths, 1, self._info.max_input_tokens)
        elif _input_size(request) <= WORD_COUNT_LIMIT:
            lengths = self._tokenizer.least_lengths(request.texts[:items])
        else:
            lengths = np.ones(min(len(request.texts), items), dtype=np.int64)
        return self._padded_tokens(lengths)

    def _padded_tokens(self, lengths: np.ndarray) -> int:
        """What items of these lengths cost once each is padded to its bucket."""
        return int(padded_lengths(lengths, self._ladder).sum())

    def _admit(self, cost: int) -> None:
        limit = self._settings.max_queued_tokens
        if cost > limit:
            raise EmbedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"texts, tokens: the request needs {cost} padded tokens, more than the server queues at once "
                f"({limit}): split it",
            )
        self._raise_if_rejected(self._screen.after_tokenizing(cost))

    def _raise_if_rejected(self, rejection: Rejection | None) -> None:
        if rejection is not None:
            self._metrics.rejected.labels(reason=rejection.reason).inc()
            raise EmbedError(grpc.StatusCode.RESOURCE_EXHAUSTED, rejection.message, rejection.retry_after_ms)

    async def _wait(self, tag: int, pending: Pending, deadline: float) -> None:
        # A timer on the loop rather than wait_for: no extra task or future per request.
        timer = asyncio.get_running_loop().call_at(deadline, self._expire, tag, pending)
        try:
            await pending.future
        except asyncio.CancelledError:
            self._link.cancel(tag)
            raise
        finally:
            timer.cancel()

    def _expire(self, tag: int, pending: Pending) -> None:
        """The deadline passed: the engine drops what is still queued, the caller hears why."""
        if pending.future.done():
            return
        self._link.cancel(tag)
        self._link.add_latency(self._clock() - pending.arrival)
        pending.future.set_exception(
            EmbedError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the request was computed")
        )

    def _response(
        self,
        request: pb.EmbedRequest,
        seqs: Sequences,
        pending: Pending,
        tokenize_s: float,
        arrival: float,
        done: float,
    ) -> pb.EmbedResponse:
        normalize = request.normalize if request.HasField("normalize") else True
        vectors = postprocess(pending.embeddings, request.dimensions, normalize)
        queue_s = max(0.0, pending.last_start - arrival - tokenize_s)
        return pb.EmbedResponse(
            embeddings=vectors.astype("<f4", copy=False).tobytes(),
            count=vectors.shape[0],
            dimensions=vectors.shape[1],
            token_counts=seqs.lengths.tolist(),
            request_id=request.request_id,
            timings=pb.Timings(
                queue_ms=queue_s * 1000,
                tokenize_ms=tokenize_s * 1000,
                inference_ms=pending.inference_s * 1000,
                total_ms=(done - arrival) * 1000,
            ),
        )

    def info(self) -> pb.InfoResponse:
        info = self._info
        return pb.InfoResponse(
            model_id=info.model_id,
            dimensions=info.dimensions,
            max_input_tokens=info.max_input_tokens,
            buckets=info.bucket_lengths,
            batch_sizes=info.batch_sizes,
            pooling=info.pooling,
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            server_version=__version__,
            excluded_token_ids=info.excluded_token_ids,
            dtype=info.dtype,
            device=info.device,
            max_batch_items=self._settings.max_items_per_request,
            batching=self._settings.batching.value,
        )


class EmbedderServicer(pb_grpc.EmbedderServicer):
    """The RPC shapes around EmbedService; counts every answer by status code."""

    def __init__(self, metrics: FrontendMetrics, gate: Gate) -> None:
        self._metrics = metrics
        self._gate = gate
        self.service: Service = WarmingUp()  # replaced, once, when the engine is warm

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        try:
            response = await self.service.embed(request, context.time_remaining(), context.peer())
        except EmbedError as error:
            self._count(error.code)
            if error.retry_after_ms:
                context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(error.retry_after_ms)),))
            await context.abort(error.code, error.message)
        self._count(grpc.StatusCode.OK)
        return response

    async def EmbedStream(
        self, request_iterator: AsyncIterator[pb.EmbedRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedResponse]:
        window = StreamWindow()
        answers: asyncio.Queue[tuple[pb.EmbedResponse, int] | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        unwritten = 0  # computed answers not yet written: each holds the gate, so a drain waits for it

        async def answer(request: pb.EmbedRequest, rows: int) -> None:
            nonlocal unwritten
            response = await self._stream_one(request, context)
            if not response.HasField("error"):
                unwritten += 1
                self._gate.hold()
            answers.put_nowait((response, rows))

        async def read() -> None:
            try:
                async for request in request_iterator:
                    rows = _item_count(request)
                    await window.take(rows)
                    task = asyncio.create_task(answer(request, rows))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*list(tasks))
            finally:
                answers.put_nowait(None)  # the writer below stops waiting, whatever ended the reading

        reader = asyncio.create_task(read())
        try:
            while (done := await answers.get()) is not None:
                response, rows = done
                yield response  # returns once gRPC has taken the answer, within the client's window
                window.give_back(rows)
                if not response.HasField("error"):
                    unwritten -= 1
                    self._gate.leave()
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            if unwritten:
                self._gate.leave(unwritten)
                if self._gate.draining:
                    self._metrics.stream_answers_dropped.inc(unwritten)
                    log.warning("drain: dropped %d computed answers its stream's client had not read", unwritten)

    async def _stream_one(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        try:
            response = await self.service.embed(request, context.time_remaining(), context.peer())
        except EmbedError as error:
            self._count(error.code)
            return pb.EmbedResponse(
                request_id=request.request_id,
                error=pb.Error(code=error.code.value[0], message=error.message, retry_after_ms=error.retry_after_ms),
            )
        self._count(grpc.StatusCode.OK)
        return response

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        try:
            return self.service.info()
        except EmbedError as error:
            await context.abort(error.code, error.message)

    def _count(self, code: grpc.StatusCode) -> None:
        self._metrics.requests.labels(code=code.name).inc()


def postprocess(rows: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """Keep the first ``dimensions`` columns (0 = all), then L2-normalize if asked; zero rows stay zero."""
    if dimensions > rows.shape[1]:
        raise ValueError(f"dimensions {dimensions} exceeds the model's {rows.shape[1]}")
    kept = rows[:, :dimensions] if dimensions else rows
    if normalize:
        norms = np.linalg.norm(kept, axis=1, keepdims=True)
        kept = kept / np.maximum(norms, np.float32(1e-12))
    return np.ascontiguousarray(kept, dtype=np.float32)
