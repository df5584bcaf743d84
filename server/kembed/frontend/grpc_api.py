"""The gRPC edge of a front end: its port (the Embedder service, health, reflection), the RPC shapes
(unary, stream, Info) around the call path in :mod:`kembed.frontend.service`, the mapping between
the proto's messages and the domain's call and result, and the one place failures become gRPC
status codes. The only module of the front end that knows the proto.

A request is checked against the limits before anything proportional to it is built. gRPC reads
a whole message before a handler runs, and protobuf parses it whole, so a message of more than
:data:`WHOLE_MESSAGE_BYTES` is first walked on the wire (:func:`scan`: a bounded number of steps,
each a few bytes) and refused there if it holds more items than a request may: five million texts
are never parsed. Once parsed: its item count before its texts are measured, its ids' byte count and
lengths before they are read as an array. Admission refusals are RESOURCE_EXHAUSTED with a
``grpc-retry-pushback-ms`` trailer (gRFC A6); every answer is counted by its status code, an
unexpected failure as INTERNAL.

What gRPC holds unweighed (a message as it is read, a stream's window) is bounded by the number of
calls a front end handles at once, lowered so that that many of the largest messages fit one memory
budget (:func:`kembed.frontend.budget.grpc_calls`). The front end counts them itself
(:class:`CallSlots`), since gRPC's own cap counts a call until its handler returns: a refusal whose
answer is paced (:mod:`kembed.frontend.pushback`) has let go of its slot and its message before it
waits, and gRPC's cap is raised by the paced answers a front end may hold. So a unary Embed is
handled as a client-streaming call of one message: its handler takes a slot before the message is
read, and drops the message with the slot.

With ``KEMBED_API_KEY_FILE`` the server's one interceptor, :class:`~kembed.frontend.auth.KeyCheck`,
answers UNAUTHENTICATED to a call of the Embedder service without a key, before any of the above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, fields
from typing import NoReturn

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # no stub
from grpc_reflection.v1alpha import reflection

from kembed.config import Settings
from kembed.contract import GRPC_PREVIOUS_ATTEMPTS_KEY, GRPC_SERVICE, RETRY_ATTEMPT_KEY, RETRY_PUSHBACK_KEY
from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.domain.prompts import PromptChoice
from kembed.frontend.auth import KeyCheck
from kembed.frontend.budget import RETRY_AFTER_MS, MemoryBudget, grpc_calls
from kembed.frontend.call import EmbedCall, EmbedResult, Limits, ServerInfo
from kembed.frontend.pushback import MAX_PACED, refusal_weight
from kembed.frontend.quantize import Encoding
from kembed.frontend.service import Gate, Service
from kembed.ipc.protocol import ServingInfo
from kembed.metrics import FrontendMetrics
from kembed.plumbing import api_keys, listen, tls
from kembed.policy.demand import retry_attempt
from kembed.policy.priority import BY_VALUE
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ENCODING_NAMES = {encoding: f"ENCODING_{encoding.name}" for encoding in Encoding}  # the proto's, by the domain's
ENCODINGS = {pb.Encoding.Value(name): encoding for encoding, name in ENCODING_NAMES.items()}

STATUS = {
    Failure.REJECTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# What Info tells of the serving engine, by the names the protocol and the proto share.
_INFO_FIELDS = sorted({f.name for f in fields(ServingInfo)} & set(pb.InfoResponse.DESCRIPTOR.fields_by_name))
# What one EmbedStream may hold, from reading a request until its answer is written: requests, and
# bytes (the requests' and their answers'), at most one of the largest messages. Past either, the
# stream stops reading.
MAX_STREAM_REQUESTS = 256
MAX_ANSWER_BYTES = 32 * 1024 * 1024  # 2,048 rows (a request's most) of 4,096 float32
# A message up to this size is parsed without a scan: at most a few thousand fields, well under a millisecond.
WHOLE_MESSAGE_BYTES = 8192
# EmbedRequest's fields besides texts: a message with more fields than texts may hold and these is refused.
OTHER_FIELDS = 16
TEXTS_FIELD, TOKENS_FIELD, LENGTHS_FIELD = 1, 2, 2  # EmbedRequest.texts, .tokens; TokenIds.lengths
_LOW_BYTES = bytes(range(128))  # a varint's last byte: one per varint in a packed field
# A call whose slot is taken back (it sent no message while others waited) weighs as this many
# refusals against its connection's pacing (at the defaults: ten at once, then five a second), so
# a client that reopens each call as it is cut cannot churn the slots at the front end's speed
# (the bystander kept 0.57 of its calls/s beside such churn unpaced).
TAKEN_BACK_WEIGHT = 100.0


class StreamWindow:
    """What one EmbedStream holds, from reading a request until its answer is written: at most
    ``requests`` requests and ``nbytes`` bytes of requests and answers (a larger request goes
    alone). A client that stops reading fills it, and the stream stops reading its requests, so
    gRPC's flow control stops the client."""

    def __init__(self, nbytes: int, requests: int = MAX_STREAM_REQUESTS) -> None:
        self._max_bytes = nbytes
        self._max_requests = requests
        self._requests = 0
        self._bytes = 0
        self._room = asyncio.Event()

    async def take(self, nbytes: int) -> None:
        """Wait for room for a request of ``nbytes``, and hold it."""
        while self._requests and (self._requests >= self._max_requests or self._bytes + nbytes > self._max_bytes):
            self._room.clear()
            await self._room.wait()
        self._requests += 1
        self._bytes += nbytes

    def give_back(self, nbytes: int) -> None:
        """A request's answer was written: it, and the request, held ``nbytes``."""
        self._requests -= 1
        self._bytes -= nbytes
        self._room.set()

    def empty(self) -> bool:
        return not self._requests


@dataclass(eq=False, slots=True)
class Slot:
    """One call's slot. ``task`` is cancelled if the slot is taken back while its call waits for a
    message (``evicted``)."""

    connection: str
    task: asyncio.Task[object] | None
    evicted: bool = False


class CallSlots:
    """The Embed calls (unary or stream) a front end handles at once, from before a request is read
    until it is answered, or refused and its answer paced; single-threaded (the event loop's).

    A call holds its slot before its message is read (gRPC holds the message as it arrives), so a
    client could hold every slot by sending a call's head and never its message. A slot is held
    unconditionally only once a message has arrived: while every slot is taken, a new call takes
    the slot of the call that has waited longest for its message on the connection with the most
    such calls, if that connection has more of them than the new call's own. That call is refused
    (RESOURCE_EXHAUSTED, with a pushback). A stream waits for a message whenever none of its
    requests is in flight. A connection's own calls never take each other's slots: a burst still
    hears "busy" past the slots, as before."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.taken = 0
        # Per connection, the slots whose calls wait for a message, oldest first; a connection is
        # here only while it has one, in the order it came to have one.
        self._waiting: dict[str, dict[Slot, None]] = {}

    def take(self, connection: str, task: asyncio.Task[object] | None) -> Slot | None:
        """Hold a slot for a call of ``connection`` that waits for its message in ``task``, if one
        is free or can be taken back from a call that has sent nothing."""
        if self.taken >= self.most and not self._take_back(connection):
            return None
        self.taken += 1
        slot = Slot(connection, task)
        self.wait(slot)
        return slot

    def wait(self, slot: Slot, task: asyncio.Task[object] | None = None) -> None:
        """The slot's call waits for a message (in ``task``, if it is another than before)."""
        if task is not None:
            slot.task = task
        self._waiting.setdefault(slot.connection, {})[slot] = None

    def read(self, slot: Slot) -> None:
        """A message of the slot's call arrived: its slot is held until it is answered."""
        waiting = self._waiting.get(slot.connection)
        if waiting is not None and waiting.pop(slot, False) is None and not waiting:
            del self._waiting[slot.connection]

    def give_back(self, slot: Slot) -> None:
        if not slot.evicted:  # an evicted slot was given back when it was taken back
            self.read(slot)
            self.taken -= 1

    def _take_back(self, connection: str) -> bool:
        """Free the slot of the call that has waited longest for its message on the connection
        with the most such calls, if it has more than ``connection``; whether one was freed."""
        waiting = self._waiting
        if not waiting:
            return False
        holder = max(waiting, key=lambda key: len(waiting[key]))  # ties: the one waiting longest
        if len(waiting[holder]) <= len(waiting.get(connection, ())):
            return False
        slot = next(iter(waiting[holder]))
        self.give_back(slot)
        slot.evicted = True
        if slot.task is not None:
            slot.task.cancel()
        return True

    def busy(self) -> EmbedError:
        return EmbedError(
            Failure.REJECTED, f"this server handles {self.most} calls at once: retry shortly", RETRY_AFTER_MS
        )

    def taken_back(self) -> EmbedError:
        return EmbedError(
            Failure.REJECTED,
            "no message arrived while calls on other connections waited for a slot: send it with the call",
            RETRY_AFTER_MS,
        )


@dataclass(frozen=True, slots=True)
class Failed:
    """A unary call's failure, as it is answered: all that is kept of the call while a refusal's
    answer is paced (not the error, whose traceback holds the request). ``paced``: a refusal of
    the service's, or a call's slot taken back: its answer is paced on its client, weighing ``weight``
    refusals."""

    failure: Failure
    message: str
    retry_after_ms: int
    paced: bool = False
    weight: float = 1.0

    @classmethod
    def of(cls, error: EmbedError, message: str, paced: bool = False, weight: float = 1.0) -> Failed:
        return cls(error.failure, message, error.retry_after_ms, paced, weight)


@dataclass(frozen=True, slots=True)
class Refused:
    """A request refused on the wire, before it was parsed (what the handler then answers)."""

    error: EmbedError


def scan(data: bytes, limits: Limits) -> str | None:
    """Why a serialized EmbedRequest must not be parsed, or None. Walks its fields without reading
    them: at most ``max_items`` texts and lengths, and a bounded number of fields in all."""
    texts, fields_left, position, end = 0, limits.max_items + OTHER_FIELDS, 0, len(data)
    while position < end:
        fields_left -= 1
        if fields_left < 0:
            return f"more than {limits.max_items + OTHER_FIELDS} fields"
        number, wire, position = _key(data, position)
        if wire != 2:
            position = _skip(data, position, wire)
            continue
        size, position = _varint(data, position)
        if number == TEXTS_FIELD:
            texts += 1
            if texts > limits.max_items:
                return f"texts: more than {limits.max_items} texts, at most {limits.max_items} per request"
        elif number == TOKENS_FIELD and _lengths(data[position : position + size], limits.max_items) > limits.max_items:
            return f"tokens.lengths: more than {limits.max_items} sequences, at most {limits.max_items} per request"
        position += size
    return None


def _lengths(tokens: bytes, bound: int) -> int:
    """How many lengths a serialized TokenIds holds, packed or not; past ``bound``, a number above it."""
    count, position, end, steps = 0, 0, len(tokens), bound + OTHER_FIELDS
    while position < end and count <= bound:
        steps -= 1
        if steps < 0:
            return bound + 1
        number, wire, position = _key(tokens, position)
        if number == LENGTHS_FIELD and wire == 0:
            count += 1
            position = _skip(tokens, position, 0)
        elif wire == 2:
            size, position = _varint(tokens, position)
            if number == LENGTHS_FIELD:  # packed: one varint per byte under 128
                count += size - len(tokens[position : position + size].translate(None, _LOW_BYTES))
            position += size
        else:
            position = _skip(tokens, position, wire)
    return count


def _key(data: bytes, position: int) -> tuple[int, int, int]:
    key, position = _varint(data, position)
    return key >> 3, key & 7, position


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    for _ in range(10):
        byte = data[position] if position < len(data) else 0
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return value, position


def _skip(data: bytes, position: int, wire: int) -> int:
    if wire == 0:
        return _varint(data, position)[1]
    return position + {1: 8, 5: 4}.get(wire, len(data))  # any other wire type ends the walk: protobuf judges it


def read_request(data: bytes, limits: Limits) -> pb.EmbedRequest | Refused:
    """A serialized EmbedRequest, parsed if it is safe to parse (the deserializer gRPC calls)."""
    reason = scan(data, limits) if len(data) > WHOLE_MESSAGE_BYTES else None
    if reason is None:
        try:
            return pb.EmbedRequest.FromString(data)
        except DecodeError:
            reason = "the message is not an EmbedRequest"
    return Refused(EmbedError(Failure.INVALID_ARGUMENT, reason))


class GrpcEdge:
    """The gRPC port: the Embedder service, gRPC health and reflection, plaintext or TLS."""

    def __init__(
        self,
        settings: Settings,
        metrics: FrontendMetrics,
        gate: Gate,
        budget: MemoryBudget,
        service: Callable[[], Service],
    ) -> None:
        """``service`` gives the call path of the moment (a refusal while warming up)."""
        self._settings = settings
        self._limits = Limits.of(settings)
        self.max_calls = grpc_calls(budget.capacity, settings.max_message_bytes, settings.max_concurrent_rpcs)
        slots = CallSlots(self.max_calls)
        self._servicer = EmbedderServicer(metrics, gate, self._limits, service, settings.max_message_bytes, slots)
        self._health = health_aio.HealthServicer()
        keys = api_keys.read(settings)
        self._server = grpc.aio.server(
            interceptors=[KeyCheck(keys, metrics)] if keys else None,
            # A bound on everything besides: the calls counted, the paced answers, and a few more
            # for health checks, Info and the calls being refused for want of a slot.
            maximum_concurrent_rpcs=self.max_calls + MAX_PACED + 64,
            options=[
                ("grpc.so_reuseport", 1),
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", MAX_ANSWER_BYTES),
                # GOAWAY past the age (gRPC's core jitters it by 10%): a client connects again through
                # the Service, to any ready pod; its calls in flight get the grace to finish.
                ("grpc.max_connection_age_ms", settings.max_connection_age_ms),
                ("grpc.max_connection_age_grace_ms", settings.connection_age_grace_ms),
            ],
        )

    async def start(self) -> None:
        """Listen on the shared gRPC port, NOT_SERVING until :meth:`set_serving`."""
        self._add_embedder()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        service_names = (
            pb.DESCRIPTOR.services_by_name["Embedder"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(service_names, self._server)
        tls.add_port(self._server, listen.host_port(self._settings.grpc_host, self._settings.grpc_port), self._settings)
        await self.set_serving(False)
        await self._server.start()

    def _add_embedder(self) -> None:
        """The Embedder service, its requests read by :func:`read_request` (what the generated
        ``add_EmbedderServicer_to_server`` does, with protobuf's own parser)."""
        servicer, limits = self._servicer, self._limits

        def deserialize(data: bytes) -> pb.EmbedRequest | Refused:
            return read_request(data, limits)

        answer = pb.EmbedResponse.SerializeToString
        handlers = {
            # Unary on the wire; read by the handler, after it has taken a slot.
            "Embed": grpc.stream_unary_rpc_method_handler(servicer.Embed, deserialize, answer),
            "EmbedStream": grpc.stream_stream_rpc_method_handler(servicer.EmbedStream, deserialize, answer),
            "Info": grpc.unary_unary_rpc_method_handler(
                servicer.Info, pb.InfoRequest.FromString, pb.InfoResponse.SerializeToString
            ),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
        # Matched by gRPC's core rather than in Python, as the generated code does (grpc-stubs lack it).
        self._server.add_registered_method_handlers(GRPC_SERVICE, handlers)  # type: ignore[attr-defined]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", GRPC_SERVICE):
            await self._health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)


class EmbedderServicer(pb_grpc.EmbedderServicer):
    """The RPC shapes around the service; counts every answer by status code."""

    def __init__(
        self,
        metrics: FrontendMetrics,
        gate: Gate,
        limits: Limits,
        service: Callable[[], Service],
        stream_window_bytes: int,
        slots: CallSlots,
    ) -> None:
        self._metrics = metrics
        self._gate = gate
        self._limits = limits
        self._service = service
        self._stream_window_bytes = stream_window_bytes
        self._slots = slots

    async def Embed(
        self, requests: AsyncIterator[pb.EmbedRequest | Refused], context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        try:
            outcome = await self._unary(context)
            if isinstance(outcome, Failed) and outcome.paced:
                await self._service().pace(context.peer(), outcome.weight)
        except asyncio.CancelledError:  # gRPC's core ended the call: its deadline passed, or its client left
            self._metrics.calls_gone.labels(api="grpc").inc()
            raise
        except Exception:  # a bug: logged, and answered INTERNAL like any failure, counted
            log.exception("Embed failed")
            await self._abort(context, grpc.StatusCode.INTERNAL, "internal error")
        if isinstance(outcome, Failed):
            if outcome.retry_after_ms:
                context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(outcome.retry_after_ms)),))
            await self._abort(context, STATUS[outcome.failure], outcome.message)
        if _past_deadline(context):  # computed too late: its client has stopped waiting
            raise self._gone()
        self._count(grpc.StatusCode.OK)
        return response(outcome)

    async def _unary(self, context: grpc.aio.ServicerContext) -> EmbedResult | Failed:
        """A unary call's result, or its failure: its request read and served holding a slot,
        neither kept once it is decided."""
        task = asyncio.current_task()
        slot = self._slots.take(context.peer(), task)
        if slot is None:
            error = self._slots.busy()
            return Failed.of(error, error.message)
        try:
            try:
                # Read off the context, not the iterator: grpc's iterator is an async generator left
                # unfinished here, whose finalizer costs the loop a wake-up and a task per call.
                request = await context.read()
            except asyncio.CancelledError:
                if not slot.evicted or task is None:
                    raise
                task.uncancel()  # its slot was taken back: refused, not gone
                error = self._slots.taken_back()
                return Failed.of(error, error.message, paced=True, weight=TAKEN_BACK_WEIGHT)
            self._slots.read(slot)
            if request is grpc.aio.EOF:  # type: ignore[attr-defined]  # no stub; the client half-closed without a message
                request = Refused(EmbedError(Failure.INVALID_ARGUMENT, "no EmbedRequest was sent"))
            try:
                return await self._embed(request, context)
            except EmbedError as error:
                if error.failure is not Failure.REJECTED:
                    return Failed.of(error, message(error, request))
                return Failed.of(error, message(error, request), paced=True, weight=_weight(request))
        finally:
            self._slots.give_back(slot)

    async def _abort(self, context: grpc.aio.ServicerContext, status: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with ``status``, counted by it. A call that ended first (its deadline passed
        or its client left, and gRPC's core has not yet told this handler) cannot be answered: the
        core refuses the answer, and the call is counted as gone instead of logged as a failure."""
        try:
            await context.abort(status, details)
        except grpc.aio.AbortError:  # answered
            self._count(status)
            raise
        except grpc.aio.InternalError:  # the core's ExecuteBatchError: no call left to answer
            raise self._gone() from None

    def _gone(self) -> asyncio.CancelledError:
        """A call that ended before its answer: counted, and ended as gRPC ends a cancelled call
        (quietly: it logs at debug level)."""
        self._metrics.calls_gone.labels(api="grpc").inc()
        return asyncio.CancelledError()

    async def EmbedStream(
        self, request_iterator: AsyncIterator[pb.EmbedRequest | Refused], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedResponse]:
        slot = self._slots.take(context.peer(), None)  # a stream holds its slot for its life
        if slot is None:
            await self._refuse_stream(context, self._slots.busy())
        try:
            async for answer in self._stream(request_iterator, context, slot):
                yield answer
        except asyncio.CancelledError:
            if not slot.evicted:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # its slot was taken back while it sent nothing: refused, not gone
            await self._service().pace(context.peer(), TAKEN_BACK_WEIGHT)
            await self._refuse_stream(context, self._slots.taken_back())
        finally:
            self._slots.give_back(slot)

    async def _refuse_stream(self, context: grpc.aio.ServicerContext, error: EmbedError) -> NoReturn:
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(error.retry_after_ms)),))
        await self._abort(context, STATUS[error.failure], error.message)

    async def _stream(
        self,
        request_iterator: AsyncIterator[pb.EmbedRequest | Refused],
        context: grpc.aio.ServicerContext,
        slot: Slot,
    ) -> AsyncIterator[pb.EmbedResponse]:
        window = StreamWindow(self._stream_window_bytes)
        answers: asyncio.Queue[tuple[pb.EmbedResponse, int] | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        unwritten = 0  # computed answers not yet written: each holds the gate, so a drain waits for it

        async def answer(request: pb.EmbedRequest | Refused, nbytes: int) -> None:
            nonlocal unwritten
            response = await self._stream_one(request, context)
            if not response.HasField("error"):
                unwritten += 1
                self._gate.hold()
            answers.put_nowait((response, nbytes))

        async def read() -> None:
            try:
                async for request in request_iterator:
                    self._slots.read(slot)
                    nbytes = self._weight(request)
                    await window.take(nbytes)
                    task = asyncio.create_task(answer(request, nbytes))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*list(tasks))
            finally:
                answers.put_nowait(None)  # the writer below stops waiting, whatever ended the reading

        reader = asyncio.create_task(read())
        self._slots.wait(slot, reader)  # until its first request
        try:
            while (done := await answers.get()) is not None:
                response, nbytes = done
                yield response  # returns once gRPC has taken the answer, within the client's window
                window.give_back(nbytes)
                if window.empty():  # nothing of its in flight: it waits for a request
                    self._slots.wait(slot)
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

    async def _stream_one(
        self, request: pb.EmbedRequest | Refused, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        request_id = "" if isinstance(request, Refused) else request.request_id
        try:
            result = await self._embed(request, context)
        except EmbedError as error:
            if error.failure is Failure.REJECTED:  # paced within the stream, which holds its own window meanwhile
                await self._service().pace(context.peer(), _weight(request))
            status = self._count_failure(error)
            return pb.EmbedResponse(
                request_id=request_id,
                error=pb.Error(
                    code=status.value[0], message=message(error, request), retry_after_ms=error.retry_after_ms
                ),
            )
        except Exception:  # a bug: this request's answer says so, and the stream carries on
            log.exception("EmbedStream request failed")
            self._count(grpc.StatusCode.INTERNAL)
            code = grpc.StatusCode.INTERNAL.value[0]
            return pb.EmbedResponse(request_id=request_id, error=pb.Error(code=code, message="internal error"))
        self._count(grpc.StatusCode.OK)
        return response(result)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        try:
            return info_response(self._service().info())
        except EmbedError as error:
            await context.abort(STATUS[error.failure], error.message)

    def _weight(self, request: pb.EmbedRequest | Refused) -> int:
        """What a stream holds for a request until its answer is written: the request, and its
        answer's float32 rows."""
        if isinstance(request, Refused):
            return 0
        try:
            dimensions = self._service().info().serving.dimensions
        except EmbedError:  # warming up: it will be refused
            dimensions = 0
        rows = len(request.tokens.lengths) if request.HasField("tokens") else len(request.texts)
        return request.ByteSize() + rows * 4 * min(request.dimensions or dimensions, dimensions)

    def _embed(self, request: pb.EmbedRequest | Refused, context: grpc.aio.ServicerContext) -> Awaitable[EmbedResult]:
        if isinstance(request, Refused):
            raise request.error
        call = to_call(request, self._limits, context.time_remaining(), context.peer(), attempt_of(context))
        return self._service().embed(call)

    def _count_failure(self, error: EmbedError) -> grpc.StatusCode:
        status = STATUS[error.failure]
        self._count(status)
        return status

    def _count(self, code: grpc.StatusCode) -> None:
        self._metrics.answered("grpc", code.name)


def _weight(request: pb.EmbedRequest | Refused) -> float:
    """What a request's refusal weighs against its client's (its bytes: :func:`refusal_weight`)."""
    return refusal_weight(0 if isinstance(request, Refused) else request.ByteSize())


def _past_deadline(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def attempt_of(context: grpc.aio.ServicerContext) -> int:
    """The call's earlier attempts, as its retry marker says: gRPC's retry policy's, or kembed's client's."""
    for key, value in context.invocation_metadata() or ():
        if key in (GRPC_PREVIOUS_ATTEMPTS_KEY, RETRY_ATTEMPT_KEY):
            return retry_attempt(value)
    return 0


def to_call(
    request: pb.EmbedRequest, limits: Limits, time_remaining: float | None, peer: str, attempt: int = 0
) -> EmbedCall:
    """The request as the domain's call, checked against ``limits`` as it is read."""
    has_texts, has_tokens = len(request.texts) > 0, request.HasField("tokens")
    if not has_texts and not has_tokens:  # proto3 cannot tell an empty list from none
        raise _invalid("texts: empty, and no tokens: nothing to embed")
    if has_texts and has_tokens:
        raise _invalid("texts, tokens: exactly one of the two must be set")
    if not 0 <= request.priority < len(BY_VALUE):  # a proto3 enum field takes any int32
        raise _invalid(f"priority: {request.priority} is not a priority class")
    if request.encoding not in ENCODINGS:
        raise _invalid(f"encoding: {request.encoding} is not an encoding")
    if request.truncation_direction not in (pb.TRUNCATION_DIRECTION_RIGHT, pb.TRUNCATION_DIRECTION_LEFT):
        raise _invalid(f"truncation_direction: {request.truncation_direction} is not a direction")
    left = request.truncation_direction == pb.TRUNCATION_DIRECTION_LEFT
    inputs = _sequences(request.tokens, limits) if has_tokens else limits.texts(request.texts, request.truncate, left)
    return EmbedCall(
        inputs=inputs,
        truncate=request.truncate,
        truncate_left=left,
        chunk=request.chunk if request.HasField("chunk") else None,
        normalize=request.normalize if request.HasField("normalize") else True,
        dimensions=request.dimensions,
        encoding=ENCODINGS[request.encoding],
        priority=BY_VALUE[request.priority],
        prompt=PromptChoice(
            request.prompt_name, request.prompt if request.HasField("prompt") else None, request.input_type
        ),
        request_id=request.request_id,
        timeout_s=time_remaining,
        peer=peer,
        attempt=attempt,
    )


def _sequences(tokens: pb.TokenIds, limits: Limits) -> Sequences:
    """The ids as sequences: a view of the request's bytes, read once their size is checked."""
    limits.check_count(len(tokens.lengths))
    # int64 holds any uint32 (a client's -1 is 4294967295) and any sum of max_items of them.
    counts = np.asarray(tokens.lengths, dtype=np.int64)
    if len(tokens.ids) % 4:
        raise EmbedError(
            Failure.INVALID_ARGUMENT, f"tokens.ids: {len(tokens.ids)} bytes is not a whole number of int32 ids"
        )
    limits.check_sizes(counts, ids=True)
    total = int(counts.sum())
    if total * 4 != len(tokens.ids):
        held = len(tokens.ids) // 4
        raise EmbedError(
            Failure.INVALID_ARGUMENT, f"tokens.lengths: sum to {total} tokens, but tokens.ids holds {held}"
        )
    return Sequences(ids=np.frombuffer(tokens.ids, dtype="<i4"), lengths=counts.astype(np.int32))


def _invalid(message: str) -> EmbedError:
    """Bad input only the wire format can have: its message names the proto's field."""
    return EmbedError(Failure.INVALID_ARGUMENT, message)


def message(error: EmbedError, request: pb.EmbedRequest | Refused) -> str:
    """The error's message, bad input named by the request's own fields."""
    if not isinstance(error, InvalidInput) or isinstance(request, Refused):
        return error.message
    return f"{_place(error, request)}: {error.reason}"


def _place(error: InvalidInput, request: pb.EmbedRequest) -> str:
    """``texts[3]``, ``tokens.lengths[2]``, ``tokens.ids[12]`` (the ids are flat on the wire)..."""
    index = "" if error.index is None else f"[{error.index}]"
    if error.field is not Field.INPUT:
        return str(error.field)
    if not request.HasField("tokens"):
        return "texts" + index
    if error.index is None or error.position is None:
        return "tokens.lengths" + index
    return f"tokens.ids[{sum(request.tokens.lengths[: error.index]) + error.position}]"


def response(result: EmbedResult) -> pb.EmbedResponse:
    vectors, timings = result.embeddings, result.timings
    return pb.EmbedResponse(
        embeddings=vectors.astype("<f4", copy=False).tobytes() if vectors.dtype == np.float32 else vectors.tobytes(),
        count=vectors.shape[0],
        dimensions=result.dimensions,
        encoding=ENCODING_NAMES[result.encoding],
        token_counts=result.token_counts.tolist(),
        request_id=result.request_id,
        timings=pb.Timings(
            queue_ms=timings.queue_s * 1000,
            tokenize_ms=timings.tokenize_s * 1000,
            inference_ms=timings.inference_s * 1000,
            total_ms=timings.total_s * 1000,
        ),
    )


def info_response(info: ServerInfo) -> pb.InfoResponse:
    return pb.InfoResponse(
        **{name: getattr(info.serving, name) for name in _INFO_FIELDS},
        buckets=info.serving.bucket_lengths,
        server_version=info.server_version,
        max_batch_items=info.max_batch_items,
        batching=info.batching,
        max_text_chars=info.max_text_chars,
        max_message_bytes=info.max_message_bytes,
        served_model_name=info.served_model_name,
        max_chunks_per_input=info.max_chunks_per_input,
        chunk_long_inputs=info.chunk_long_inputs,
        forward=info.forward,
        admission_budget_tokens=info.admission_budget_tokens,
        max_connection_age_ms=info.max_connection_age_ms,
        max_connection_age_grace_ms=info.max_connection_age_grace_ms,
    )
