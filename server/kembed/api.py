"""The gRPC edge: validate → tokenize (off the loop) → admit → submit → await → respond.

Every failure becomes a gRPC status whose message names the field or the reason: bad input is
INVALID_ARGUMENT before it can reach a shared batch; admission rejections are RESOURCE_EXHAUSTED
with a ``grpc-retry-pushback-ms`` trailer; warming up or draining is UNAVAILABLE; work whose
deadline passed is dropped before compute and answered DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
import numpy as np

from kembed import __version__
from kembed.admission import AdmissionController, Rejection
from kembed.batcher import Batcher
from kembed.buckets import Routed, padded_tokens, route
from kembed.config import Settings
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.inputs import InputError, Sequences
from kembed.metrics import Metrics
from kembed.model import EmbeddingModel
from kembed.pooling import postprocess
from kembed.responder import BatchFailed
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from kembed.work import Job
from kembed.worker import Plan

MAX_REQUEST_ID_CHARS = 256
MAX_STREAM_IN_FLIGHT = 256  # per stream: beyond this the server stops reading (back-pressure)
# Inputs up to this many characters or id bytes are tokenized on the event loop: a trip through the
# executor (two thread switches and a loop wake-up) costs more than tokenizing a sentence, and on a
# busy machine those switches steal time from the model. Larger inputs still go to the executor.
INLINE_PREPARE_LIMIT = 2048


def _input_size(request: pb.EmbedRequest) -> int:
    """Characters of text, or bytes of ids: what tokenizing or checking the request costs."""
    if request.HasField("tokens"):
        return len(request.tokens.ids)
    return sum(len(text) for text in request.texts)


class EmbedError(Exception):
    """A request's failure, as the gRPC status it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class Gate:
    """Whether requests are taken (closed while warming up and once draining), and how many are
    in progress, so a drain knows when everything accepted has been answered."""

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def accepting(self) -> bool:
        return self.ready and not self.draining

    def enter(self) -> None:
        if self.draining:
            raise EmbedError(grpc.StatusCode.UNAVAILABLE, "server is draining: retry on another replica")
        if not self.ready:
            raise EmbedError(grpc.StatusCode.UNAVAILABLE, "server is warming up: retry shortly")
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


@dataclass
class Pipeline:
    """Everything a request passes through once the model is warm."""

    settings: Settings
    model: EmbeddingModel
    plan: Plan
    batcher: Batcher
    admission: AdmissionController
    executor: Executor


class EmbedService:
    """One request's path, independent of the RPC shape (unary or stream)."""

    def __init__(
        self, pipeline: Pipeline, gate: Gate, metrics: Metrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._p = pipeline
        self._gate = gate
        self._metrics = metrics
        self._clock = clock

    async def embed(self, request: pb.EmbedRequest, time_remaining: float | None) -> pb.EmbedResponse:
        arrival = self._clock()
        self._gate.enter()
        try:
            return await self._embed(request, arrival, time_remaining)
        finally:
            self._gate.leave()

    async def _embed(self, request: pb.EmbedRequest, arrival: float, time_remaining: float | None) -> pb.EmbedResponse:
        p = self._p
        self._validate(request)
        self._screen(request)
        loop = asyncio.get_running_loop()
        try:
            if _input_size(request) <= INLINE_PREPARE_LIMIT:
                seqs, routed = self._prepare(request)
            else:
                seqs, routed = await loop.run_in_executor(p.executor, self._prepare, request)
        except InputError as error:
            raise EmbedError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        tokenized = self._clock()
        cost = padded_tokens(routed, p.plan.bucket_lengths)
        self._admit(cost)
        budget = p.settings.default_timeout_ms / 1000 if time_remaining is None else time_remaining
        job = Job(
            request_id=request.request_id,
            token_counts=seqs.lengths,
            padded_tokens=cost,
            arrival=arrival,
            deadline=arrival + budget,
            future=loop.create_future(),
            rows=np.empty((seqs.count, p.model.info.dimensions), dtype=np.float32),
        )
        p.batcher.submit(job, routed)
        await self._wait(job)
        done = self._clock()
        p.admission.latency.add(done - arrival)
        self._metrics.request_duration.observe(done - arrival)
        return self._response(request, job, tokenized - arrival, done - arrival)

    def _validate(self, request: pb.EmbedRequest) -> None:
        has_texts, has_tokens = len(request.texts) > 0, request.HasField("tokens")
        if has_texts == has_tokens:
            raise EmbedError(grpc.StatusCode.INVALID_ARGUMENT, "texts, tokens: exactly one of the two must be set")
        dimensions = self._p.model.info.dimensions
        if request.dimensions > dimensions:
            raise EmbedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"dimensions: {request.dimensions} exceeds the model's {dimensions}",
            )
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise EmbedError(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters"
            )

    def _prepare(self, request: pb.EmbedRequest) -> tuple[Sequences, list[Routed]]:
        """Runs in the executor: tokenization and routing stay off the event loop."""
        tokenizer = self._p.model.tokenizer
        if request.HasField("tokens"):
            seqs = tokenizer.from_token_bytes(request.tokens.ids, request.tokens.lengths, request.truncate)
        else:
            seqs = tokenizer.from_texts(request.texts, request.truncate)
        return seqs, route(seqs, self._p.plan.bucket_lengths, self._p.model.info.pad_token_id)

    def _screen(self, request: pb.EmbedRequest) -> None:
        """Refuse what overload would refuse anyway before paying for tokenization."""
        p = self._p
        count = len(request.tokens.lengths) if request.HasField("tokens") else len(request.texts)
        lower_bound = min(count, p.settings.max_items_per_request) * p.plan.bucket_lengths[0]
        self._raise_if_rejected(p.admission.screen(lower_bound, p.batcher.backlog_tokens))

    def _admit(self, cost: int) -> None:
        p = self._p
        if cost > p.settings.max_queued_tokens:
            raise EmbedError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"texts, tokens: the request needs {cost} padded tokens, more than the server queues at once "
                f"({p.settings.max_queued_tokens}): split it",
            )
        self._raise_if_rejected(p.admission.admit(cost, p.batcher.backlog_tokens))

    def _raise_if_rejected(self, rejection: Rejection | None) -> None:
        if rejection is not None:
            self._metrics.rejected.labels(reason=rejection.reason).inc()
            raise EmbedError(grpc.StatusCode.RESOURCE_EXHAUSTED, rejection.message, rejection.retry_after_ms)

    async def _wait(self, job: Job) -> None:
        timeout = max(0.0, job.deadline - self._clock())
        try:
            await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except TimeoutError:
            self._abandon(job)
            self._p.admission.latency.add(self._clock() - job.arrival)
            raise EmbedError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the request was computed"
            ) from None
        except asyncio.CancelledError:
            self._abandon(job)
            raise
        except BatchFailed as error:
            raise EmbedError(grpc.StatusCode.INTERNAL, str(error)) from None

    def _abandon(self, job: Job) -> None:
        """Whatever of the job is still queued is dropped before it reaches the model."""
        job.abandon()
        self._p.batcher.forget(job)

    def _response(self, request: pb.EmbedRequest, job: Job, tokenize_s: float, total_s: float) -> pb.EmbedResponse:
        normalize = request.normalize if request.HasField("normalize") else True
        vectors = postprocess(job.rows, request.dimensions, normalize)
        queue_s = max(0.0, job.last_start - job.arrival - tokenize_s)
        return pb.EmbedResponse(
            embeddings=vectors.astype("<f4", copy=False).tobytes(),
            count=vectors.shape[0],
            dimensions=vectors.shape[1],
            token_counts=job.token_counts.tolist(),
            request_id=request.request_id,
            timings=pb.Timings(
                queue_ms=queue_s * 1000,
                tokenize_ms=tokenize_s * 1000,
                inference_ms=job.inference_s * 1000,
                total_ms=total_s * 1000,
            ),
        )

    def info(self) -> pb.InfoResponse:
        p = self._p
        info = p.model.info
        return pb.InfoResponse(
            model_id=info.model_id,
            dimensions=info.dimensions,
            max_input_tokens=info.max_input_tokens,
            buckets=p.plan.bucket_lengths,
            batch_sizes=p.plan.shapes.sizes,
            pooling=info.pooling,
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
            server_version=__version__,
            excluded_token_ids=info.excluded_token_ids,
            dtype=str(info.dtype).removeprefix("torch."),
            device=str(info.device),
            max_batch_items=p.settings.max_items_per_request,
            batching=p.settings.batching.value,
        )


class EmbedderServicer(pb_grpc.EmbedderServicer):
    """The RPC shapes around EmbedService; counts every answer by status code."""

    def __init__(self, gate: Gate, metrics: Metrics) -> None:
        self._gate = gate
        self._metrics = metrics
        self.service: EmbedService | None = None  # set once the model is warm

    def _service(self) -> EmbedService:
        if self.service is None:
            raise EmbedError(grpc.StatusCode.UNAVAILABLE, "server is warming up: retry shortly")
        return self.service

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        try:
            response = await self._service().embed(request, context.time_remaining())
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
        answers: asyncio.Queue[pb.EmbedResponse | None] = asyncio.Queue()
        slots = asyncio.Semaphore(MAX_STREAM_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def answer(request: pb.EmbedRequest) -> None:
            try:
                await answers.put(await self._stream_one(request, context.time_remaining()))
            finally:
                slots.release()

        async def read() -> None:
            async for request in request_iterator:
                await slots.acquire()
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks))
            await answers.put(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await answers.get()) is not None:
                yield response
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _stream_one(self, request: pb.EmbedRequest, time_remaining: float | None) -> pb.EmbedResponse:
        try:
            response = await self._service().embed(request, time_remaining)
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
            return self._service().info()
        except EmbedError as error:
            await context.abort(error.code, error.message)

    def _count(self, code: grpc.StatusCode) -> None:
        self._metrics.requests.labels(code=code.name).inc()
