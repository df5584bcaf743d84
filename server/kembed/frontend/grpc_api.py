"""The gRPC edge of a front end: the RPC shapes (unary, stream, Info) around the request path in
:mod:`kembed.frontend.service`, and the one place its failures become gRPC status codes.

Admission refusals are RESOURCE_EXHAUSTED with a ``grpc-retry-pushback-ms`` trailer (gRFC A6);
every answer is counted by its status code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.errors import EmbedError, Failure
from kembed.frontend.service import Gate, Service, WarmingUp, item_count
from kembed.metrics import FrontendMetrics
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATUS = {
    Failure.REJECTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# What one EmbedStream may hold, from reading a request until its answer is written: requests,
# and answer rows (6 MiB of float32 at 384 dimensions). Past either, the stream stops reading.
MAX_STREAM_REQUESTS = 256
MAX_STREAM_ROWS = 4096


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
            status = self._count_failure(error)
            if error.retry_after_ms:
                context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(error.retry_after_ms)),))
            await context.abort(status, error.message)
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
                    rows = item_count(request)
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
            status = self._count_failure(error)
            return pb.EmbedResponse(
                request_id=request.request_id,
                error=pb.Error(code=status.value[0], message=error.message, retry_after_ms=error.retry_after_ms),
            )
        self._count(grpc.StatusCode.OK)
        return response

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        try:
            return self.service.info()
        except EmbedError as error:
            await context.abort(STATUS[error.failure], error.message)

    def _count_failure(self, error: EmbedError) -> grpc.StatusCode:
        status = STATUS[error.failure]
        self._count(status)
        return status

    def _count(self, code: grpc.StatusCode) -> None:
        self._metrics.requests.labels(api="grpc", code=code.name).inc()
