"""The server's lifecycle: listen at once (answering UNAVAILABLE), let the worker warm up, open the
gate, and on SIGTERM close it, finish everything accepted, then stop.

Readiness, gRPC health and the gate move together: warming up and draining are NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # no stub
from grpc_reflection.v1alpha import reflection

from kembed.admission import AdmissionController
from kembed.api import EmbedderServicer, EmbedService, Gate, Pipeline
from kembed.batcher import Batcher
from kembed.buckets import BucketQueue
from kembed.config import Settings
from kembed.contract import GRPC_SERVICE
from kembed.http import HealthServer
from kembed.metrics import Metrics
from kembed.responder import Responder
from kembed.v1 import embedder_pb2, embedder_pb2_grpc
from kembed.work import Batch
from kembed.worker import Outcome, Worker

log = logging.getLogger(__name__)

LIVENESS_STALE_S = 60.0  # a worker or loop silent this long is stuck: let Kubernetes restart it
LOOP_TICK_S = 1.0
FATAL_EXIT_CODE = 70
TOKENIZER_THREADS = 2


class StartupError(RuntimeError):
    pass


class KembedServer:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.gate = Gate()
        self.admission = AdmissionController(settings)
        self.started = time.monotonic()
        self._loop_tick = self.started
        self._servicer = EmbedderServicer(self.gate, self.metrics)
        self._health = health_aio.HealthServicer()
        self._responder: Responder | None = None
        self._batcher: Batcher | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kembed-tokenize")
        self._grpc = grpc.aio.server(
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                ("grpc.max_connection_age_ms", settings.max_connection_age_ms),
                ("grpc.max_connection_age_grace_ms", int(settings.drain_timeout_s * 1000)),
            ],
        )
        self.http = HealthServer(
            settings.http_host,
            settings.http_port,
            live=self.live,
            ready=lambda: self.gate.accepting,
            health=self.health,
            registry=self.metrics.registry,
        )
        self.worker: Worker | None = None
        self.grpc_port = 0
        self.fatal = asyncio.Event()

    async def start(self) -> None:
        """Listen on both ports and start the worker's load and warmup; returns before it ends."""
        loop = asyncio.get_running_loop()
        self.worker = Worker(self.settings, loop, self._deliver, self._on_fatal)
        embedder_pb2_grpc.add_EmbedderServicer_to_server(self._servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        service_names = (
            embedder_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(service_names, self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.settings.grpc_host}:{self.settings.grpc_port}")
        await self._set_serving(False)
        await self._grpc.start()
        self.http.start()
        self.worker.start()
        self._tasks.append(asyncio.create_task(self._tick()))
        self.metrics.bind(
            drain_seconds=lambda: self.admission.drain_seconds(self._backlog()),
            p95_seconds=self.admission.p95_seconds,
            queued_tokens=self._backlog,
            service_rate=lambda: self.admission.rate.tokens_per_second,
            worker_queue_depth=lambda: self._batcher.in_flight if self._batcher else 0,
            ready=lambda: float(self.gate.accepting),
        )

    async def wait_ready(self) -> None:
        """Wait out the worker's load and warmup, then open the gate."""
        worker = self._require_worker()
        await asyncio.shield(worker.warm)
        engine = worker.engine
        if engine is None:
            raise StartupError(f"model failed to load: {worker.error}")
        model, plan = engine.model, engine.plan
        self._batcher = Batcher(
            BucketQueue(plan.bucket_lengths),
            plan.shapes,
            worker.submit,
            max_wait=self.settings.max_wait_ms / 1000,
            naive=plan.naive,
        )
        self._responder = Responder(self._batcher, self.admission, self.metrics)
        self.admission.rate.seed(engine.warmup_tokens, engine.warmup_seconds)
        pipeline = Pipeline(self.settings, model, plan, self._batcher, self.admission, self._executor)
        self._servicer.service = EmbedService(pipeline, self.gate, self.metrics)
        self._tasks.append(asyncio.create_task(self._batcher.run()))
        self._tasks[-1].add_done_callback(self._batcher_stopped)
        # Everything loaded so far (model, tokenizer, libraries) lives as long as the process: moved
        # out of the collector's sight, full collections stop walking it and stalling the loop.
        gc.collect()
        gc.freeze()
        self.gate.ready = True
        await self._set_serving(True)

    async def drain(self) -> None:
        """Stop taking work, answer everything accepted, then stop listening."""
        self.gate.draining = True
        await self._set_serving(False)
        log.info("draining: %d requests in progress", self.gate.active)
        try:
            await asyncio.wait_for(self.gate.wait_idle(), self.settings.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out with %d requests in progress", self.gate.active)
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None) -> None:
        await self._grpc.stop(grace)
        for task in self._tasks:
            task.cancel()
        if self.worker is not None:
            self.worker.stop()
        self.http.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def live(self) -> bool:
        """Alive while the worker thread runs and neither it (once warm) nor the loop is stuck."""
        worker = self.worker
        if worker is None or (not worker.alive() and worker.error is None):
            return False
        now = time.monotonic()
        loop_ok = now - self._loop_tick < LIVENESS_STALE_S
        worker_ok = not self.gate.ready or now - worker.heartbeat < LIVENESS_STALE_S
        return loop_ok and worker_ok and not self.fatal.is_set()

    def health(self) -> dict[str, Any]:
        backlog = self._backlog()
        drain = self.admission.drain_seconds(backlog)
        p95 = self.admission.p95_seconds()
        engine = self.worker.engine if self.worker else None
        return {
            "status": self._status(drain, p95),
            "accepting_requests": self.gate.accepting,
            "queued_tokens": backlog,
            "service_rate_tokens_per_sec": round(self.admission.rate.tokens_per_second, 1),
            "estimated_drain_time_ms": round(drain * 1000, 1),
            "p95_server_side_latency_ms": round(p95 * 1000, 1),
            "worker_queue_depth": self._batcher.in_flight if self._batcher else 0,
            "embedding_dimension": engine.model.info.dimensions if engine else None,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
        }

    def _status(self, drain: float, p95: float) -> str:
        if self.gate.draining:
            return "draining"
        if not self.gate.ready:
            return "starting"
        if drain * 1000 > self.settings.max_drain_ms or p95 * 1000 > self.settings.p95_hard_ms:
            return "overloaded"
        return "degraded" if self.admission.shedding else "healthy"

    def _backlog(self) -> int:
        return self._batcher.backlog_tokens if self._batcher else 0

    def _require_worker(self) -> Worker:
        if self.worker is None:
            raise StartupError("start() first")
        return self.worker

    def _deliver(self, batch: Batch, outcomes: list[Outcome], started: float, seconds: float) -> None:
        if self._responder is not None:
            self._responder.deliver(batch, outcomes, started, seconds)

    def _batcher_stopped(self, task: asyncio.Task[None]) -> None:
        """The batcher only ends by cancellation; anything else is a bug that would hang every request."""
        if not task.cancelled() and task.exception() is not None:
            self._on_fatal(task.exception() or RuntimeError("batcher stopped"))

    def _on_fatal(self, error: BaseException) -> None:
        """The device is poisoned: report NOT_SERVING and exit so Kubernetes restarts the pod."""
        log.critical("worker died: %s; exiting with %d", error, FATAL_EXIT_CODE)
        self.gate.draining = True
        self.fatal.set()
        self._tasks.append(asyncio.create_task(self._set_serving(False)))
        asyncio.get_running_loop().call_later(0.5, os._exit, FATAL_EXIT_CODE)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GRPC_SERVICE):
            await self._health.set(service, status)

    async def _tick(self) -> None:
        """The event loop's heartbeat for /livez: a sleeping task, not a poll."""
        while True:
            self._loop_tick = time.monotonic()
            await asyncio.sleep(LOOP_TICK_S)
