"""The gRPC edge of a front end: its port (the Embedder service, health, reflection) and the RPC
shapes (unary, stream, Info) around the call path in :mod:`kembed.frontend.service`. Its messages
are mapped to the domain's call and result, and failures to status codes, by
:mod:`kembed.frontend.grpc_messages`; with it, the only module of the front end that knows the proto.

A request is checked against the limits before anything proportional to it is built: a large
message is walked on the wire before it is parsed (:mod:`kembed.frontend.proto_scan`), a parsed one
checked as it becomes the domain's call. Admission refusals are RESOURCE_EXHAUSTED with a
``grpc-retry-pushback-ms`` trailer (gRFC A6); every answer is counted by its status code, an
unexpected failure as INTERNAL.

What gRPC holds unweighed (a message as it is read, a stream's window) is bounded by the number of
calls a front end handles at once, lowered so that that many of the largest messages fit one memory
budget (:func:`kembed.frontend.budget.grpc_calls`). The front end counts them itself
(:class:`~kembed.frontend.grpc_slots.CallSlots`), since gRPC's own cap counts a call until its
handler returns: a refusal whose answer is paced (:mod:`kembed.frontend.pushback`) has let go of
its slot and its message before it waits, and gRPC's cap is raised by the paced answers a front end
may hold. So a unary Embed is handled as a client-streaming call of one message: its handler takes
a slot before the message is read, and drops the message with the slot.

With ``KEMBED_API_KEY_FILE`` the server's one interceptor, :class:`~kembed.frontend.auth.KeyCheck`,
answers UNAUTHENTICATED to a call of the Embedder service without a key, before any of the above.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # no stub
from grpc_reflection.v1alpha import reflection

from kembed.config.settings import Settings
from kembed.contract import GRPC_SERVICE, REQUEST_ID_KEY, RETRY_PUSHBACK_KEY
from kembed.domain.errors import EmbedError, Failure
from kembed.frontend import tracing
from kembed.frontend.auth import KeyCheck
from kembed.frontend.budget import MemoryBudget, grpc_calls
from kembed.frontend.call import EmbedResult, Limits
from kembed.frontend.gate import Gate
from kembed.frontend.grpc_messages import (
    STATUS,
    Refused,
    attempt_of,
    info_response,
    message,
    offered_request_id,
    read_request,
    response,
    to_call,
)
from kembed.frontend.grpc_slots import CallSlots, Slot, StreamWindow
from kembed.frontend.pushback import MAX_PACED, PacedAnswers, Refusal, refusal_weight
from kembed.frontend.service import Service
from kembed.metrics import FrontendMetrics
from kembed.plumbing import api_keys, listen, request_log, tls
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 32 * 1024 * 1024  # 2,048 rows (a request's most) of 4,096 float32
# A call whose slot is taken back (it sent no message while others waited) weighs as this many
# refusals against its connection's pacing (at the defaults: ten at once, then five a second), so
# a client that reopens each call as it is cut cannot churn the slots at the front end's speed
# (the bystander kept 0.57 of its calls/s beside such churn unpaced).
TAKEN_BACK_WEIGHT = 100.0


@dataclass(frozen=True, slots=True)
class Failed:
    """A unary call's failure, as it is answered: all that is kept of the call while a refusal's
    answer is paced (not the error, whose traceback holds the request). ``refusal``: the service's,
    or a call's slot taken back: its answer is paced on its client, weighing ``weight`` refusals."""

    failure: Failure
    message: str
    retry_after_ms: int
    refusal: Refusal | None = None
    weight: float = 1.0

    @classmethod
    def of(cls, error: EmbedError, message: str) -> Failed:
        return cls(error.failure, message, error.retry_after_ms)

    @classmethod
    def paced(cls, refusal: Refusal, weight: float) -> Failed:
        return cls(Failure.REJECTED, refusal.message, refusal.retry_after_ms, refusal, weight)


class GrpcEdge:
    """The gRPC port: the Embedder service, gRPC health and reflection, plaintext or TLS."""

    def __init__(
        self,
        settings: Settings,
        metrics: FrontendMetrics,
        gate: Gate,
        budget: MemoryBudget,
        paced: PacedAnswers,
        service: Callable[[], Service],
    ) -> None:
        """``service`` gives the call path of the moment (a refusal while warming up); ``paced``
        paces the refusals of calls whose slots are taken back, as the service's own."""
        self._settings = settings
        self._limits = Limits.of(settings)
        self.max_calls = grpc_calls(budget.capacity, settings.max_message_bytes, settings.max_concurrent_rpcs)
        slots = CallSlots(self.max_calls)
        self._servicer = EmbedderServicer(
            metrics, gate, self._limits, service, settings.max_message_bytes, slots, paced
        )
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
        paced: PacedAnswers,
    ) -> None:
        self._metrics = metrics
        self._gate = gate
        self._limits = limits
        self._service = service
        self._stream_window_bytes = stream_window_bytes
        self._slots = slots
        self._paced = paced

    async def Embed(
        self, requests: AsyncIterator[pb.EmbedRequest | Refused], context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        offered = offered_request_id(context)
        request_log.request_id.set(request_log.adopt(offered))  # this call's task alone
        try:
            outcome = await self._unary(context, offered is None)
            if isinstance(outcome, Failed) and outcome.refusal is not None:
                await outcome.refusal.answerable(outcome.weight)
        except asyncio.CancelledError:  # gRPC's core ended the call: its deadline passed, or its client left
            self._metrics.calls_gone.labels(api="grpc").inc()
            raise
        except Exception:  # a bug: logged, and answered INTERNAL like any failure, counted
            log.exception("Embed failed")
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_log.request_id.get()),))
            await self._abort(context, grpc.StatusCode.INTERNAL, "internal error")
        named = (REQUEST_ID_KEY, request_log.request_id.get())
        if isinstance(outcome, Failed):
            pushback = [(RETRY_PUSHBACK_KEY, str(outcome.retry_after_ms))] if outcome.retry_after_ms else []
            context.set_trailing_metadata((named, *pushback))
            await self._abort(context, STATUS[outcome.failure], outcome.message)
        if _past_deadline(context):  # computed too late: its client has stopped waiting
            raise self._gone()
        context.set_trailing_metadata((named, *outcome.timing_headers()))
        self._count(grpc.StatusCode.OK)
        tracing.record("Embed", lambda: dict(context.invocation_metadata() or ()), outcome)
        return response(outcome)

    async def _unary(self, context: grpc.aio.ServicerContext, unnamed: bool) -> EmbedResult | Failed:
        """A unary call's result, or its failure: its request read and served holding a slot,
        neither kept once it is decided. A call whose metadata is ``unnamed`` takes its message's
        request_id as its id, if it has one."""
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
                return Failed.paced(self._paced.refusal(context.peer(), self._slots.taken_back()), TAKEN_BACK_WEIGHT)
            self._slots.read(slot)
            if request is grpc.aio.EOF:  # type: ignore[attr-defined]  # no stub; the client half-closed without a message
                request = Refused(EmbedError(Failure.INVALID_ARGUMENT, "no EmbedRequest was sent"))
            elif unnamed and not isinstance(request, Refused) and request.request_id:
                request_log.request_id.set(request_log.adopt(request.request_id))
            try:
                outcome = await self._embed(request, context)
            except EmbedError as error:
                return Failed.of(error, message(error, request))
            return Failed.paced(outcome, _weight(request)) if isinstance(outcome, Refusal) else outcome
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
        request_log.request_id.set(request_log.adopt(offered_request_id(context)))  # the stream's
        slot = self._slots.take(context.peer(), None)  # a stream holds its slot for its life
        if slot is None:
            await self._refuse_stream(context, self._slots.busy())
        try:
            async for answer in self._stream(request_iterator, context, slot):
                yield answer
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_log.request_id.get()),))
        except asyncio.CancelledError:
            if not slot.evicted:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # its slot was taken back while it sent nothing: refused, not gone
            refusal = self._paced.refusal(context.peer(), self._slots.taken_back())
            await refusal.answerable(TAKEN_BACK_WEIGHT)
            await self._refuse_stream(context, refusal.error)
        finally:
            self._slots.give_back(slot)

    async def _refuse_stream(self, context: grpc.aio.ServicerContext, error: EmbedError) -> NoReturn:
        pushback = (RETRY_PUSHBACK_KEY, str(error.retry_after_ms))
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_log.request_id.get()), pushback))
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

        stream_id = request_log.request_id.get()

        async def answer(request: pb.EmbedRequest | Refused, nbytes: int) -> None:
            nonlocal unwritten
            if not isinstance(request, Refused) and request.request_id:  # each request's task its own
                request_log.request_id.set(request_log.adopt(f"{stream_id}:{request.request_id}"))
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
            if isinstance(result, Refusal):  # paced within the stream, which holds its own window meanwhile
                await result.answerable(_weight(request))
                raise result.error
        except EmbedError as error:
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
        tracing.record("EmbedStream", lambda: dict(context.invocation_metadata() or ()), result)
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

    def _embed(
        self, request: pb.EmbedRequest | Refused, context: grpc.aio.ServicerContext
    ) -> Awaitable[EmbedResult | Refusal]:
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
