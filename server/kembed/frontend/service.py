"""One request's path through a front end, whatever edge it came in by: validate → pre-screen →
tokenize → admit → engine → respond.

The proto's ``EmbedRequest`` and ``EmbedResponse`` are the request and the answer for every edge
(the gRPC edge passes them through; others map their own formats to them). Every failure is an
:class:`~kembed.errors.EmbedError` whose message names the field or the reason: bad input is
INVALID_ARGUMENT before it can reach a shared batch; admission refusals are REJECTED with a
pushback; warming up or draining is UNAVAILABLE; work whose deadline passed is dropped before
compute and answered DEADLINE. Each edge maps them to its transport's codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import fields
from typing import Protocol

import numpy as np
import tokenizers

from kembed import __version__
from kembed.admission import Rejection
from kembed.config import Settings
from kembed.errors import EmbedError, Failure
from kembed.frontend.link import EngineLink, Pending
from kembed.frontend.pushback import ConnectionPushback, HeldCalls
from kembed.frontend.screen import Screen
from kembed.inputs import InputError, Sequences, Tokenizer
from kembed.metrics import FrontendMetrics
from kembed.priority import BY_VALUE, Priority
from kembed.protocol import ServingInfo
from kembed.shapes import padded_lengths
from kembed.v1 import embedder_pb2 as pb

MAX_REQUEST_ID_CHARS = 256
PRIORITIES = frozenset(Priority)  # a proto3 enum field takes any int32: these are the known ones
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


# What Info tells of the serving engine, by the names the protocol and the proto share.
_INFO_FIELDS = sorted({f.name for f in fields(ServingInfo)} & set(pb.InfoResponse.DESCRIPTOR.fields_by_name))


def item_count(request: pb.EmbedRequest) -> int:
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
            raise EmbedError(Failure.UNAVAILABLE, "server is draining: retry on another replica")

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


class Service(Protocol):
    """What the RPCs call: the real path once the engine is warm, a refusal before."""

    async def embed(
        self, request: pb.EmbedRequest, time_remaining: float | None, connection: str
    ) -> pb.EmbedResponse: ...

    def info(self) -> pb.InfoResponse: ...


def warming_up() -> EmbedError:
    return EmbedError(Failure.UNAVAILABLE, "server is warming up: retry shortly")


class WarmingUp:
    """The service until the engine is warm: every call is UNAVAILABLE."""

    async def embed(self, request: pb.EmbedRequest, time_remaining: float | None, connection: str) -> pb.EmbedResponse:
        raise warming_up()

    def info(self) -> pb.InfoResponse:
        raise warming_up()


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
        self._bucket_lengths = np.asarray(info.bucket_lengths)
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
                self._pushback.refused((connection, request.priority), error.retry_after_ms)
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
        priority = BY_VALUE[request.priority]
        least_cost = self._least_cost(request)
        if self._pushback.must_wait((connection, priority)):
            self._metrics.pushback_waits.inc()
            await self._held.wait((connection, priority), least_cost, priority)
            # Then handled as if it had just arrived: its wait was its client's own doing.
            self._gate.check_open()
            arrival = self._clock()
        self._raise_if_rejected(self._screen.before_tokenizing(least_cost, priority), priority)
        try:
            if _input_size(request) <= INLINE_PREPARE_LIMIT:
                seqs = self._tokenize(request)  # on the event loop: no other call is screened meanwhile
            else:
                with self._screen.tokenizing(least_cost, priority):
                    seqs = await asyncio.get_running_loop().run_in_executor(self._executor, self._tokenize, request)
        except InputError as error:
            raise EmbedError(Failure.INVALID_ARGUMENT, str(error)) from None
        tokenized = self._clock()
        cost = self._padded_tokens(seqs.lengths)
        self._admit(cost, priority)
        tag, pending = self._link.submit(seqs, cost, arrival, deadline, priority)
        await self._wait(tag, pending, deadline)
        done = self._clock()
        self._link.add_latency(done - arrival, priority)
        self._metrics.request_durations[priority].observe(done - arrival)
        return self._response(request, seqs, pending, tokenized - arrival, arrival, done)

    def _validate(self, request: pb.EmbedRequest) -> None:
        has_texts, has_tokens = len(request.texts) > 0, request.HasField("tokens")
        if has_texts == has_tokens:
            raise EmbedError(Failure.INVALID_ARGUMENT, "texts, tokens: exactly one of the two must be set")
        dimensions = self._info.dimensions
        if request.dimensions > dimensions:
            raise EmbedError(
                Failure.INVALID_ARGUMENT,
                f"dimensions: {request.dimensions} exceeds the model's {dimensions}",
            )
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise EmbedError(Failure.INVALID_ARGUMENT, f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters")
        if request.priority not in PRIORITIES:
            raise EmbedError(Failure.INVALID_ARGUMENT, f"priority: {request.priority} is not a priority class")

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
        return int(padded_lengths(lengths, self._bucket_lengths).sum())

    def _admit(self, cost: int, priority: Priority) -> None:
        limit = self._settings.max_queued_tokens
        if cost > limit:
            raise EmbedError(
                Failure.INVALID_ARGUMENT,
                f"texts, tokens: the request needs {cost} padded tokens, more than the server queues at once "
                f"({limit}): split it",
            )
        self._raise_if_rejected(self._screen.after_tokenizing(cost, priority), priority)

    def _raise_if_rejected(self, rejection: Rejection | None, priority: Priority) -> None:
        if rejection is not None:
            self._metrics.rejected.labels(reason=rejection.reason, priority=priority.label).inc()
            raise EmbedError(Failure.REJECTED, rejection.message, rejection.retry_after_ms)

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
        self._link.add_latency(self._clock() - pending.arrival, pending.priority)
        pending.future.set_exception(EmbedError(Failure.DEADLINE, "deadline passed before the request was computed"))

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
            **{name: getattr(info, name) for name in _INFO_FIELDS},
            buckets=info.bucket_lengths,
            server_version=__version__,
            max_batch_items=self._settings.max_items_per_request,
            batching=self._settings.batching.value,
            max_text_chars=self._settings.max_text_chars,
            max_message_bytes=self._settings.max_message_bytes,
        )


def postprocess(rows: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """Keep the first ``dimensions`` columns (0 = all), then L2-normalize if asked; zero rows stay zero."""
    if dimensions > rows.shape[1]:
        raise ValueError(f"dimensions {dimensions} exceeds the model's {rows.shape[1]}")
    kept = rows[:, :dimensions] if dimensions else rows
    if normalize:
        norms = np.linalg.norm(kept, axis=1, keepdims=True)
        kept = kept / np.maximum(norms, np.float32(1e-12))
    return np.ascontiguousarray(kept, dtype=np.float32)
