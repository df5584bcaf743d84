"""The engine process: it owns the model (on the worker thread), the global queue and the answers.

It listens on a Unix socket at once, so front ends connect while the model loads and warms up.
When warm it builds the serving path once (:class:`Core`, the composition root), publishes the
board's first state, and tells every front end READY. It exits when the supervisor says so (SIGTERM,
once every front end has drained), when its parent dies, or with FATAL_EXIT_CODE when the device
fails, so the supervisor takes the whole server down and Kubernetes restarts the pod.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kembed.admission import AdmissionController, MeasuredLoad
from kembed.config import Settings
from kembed.engine.batcher import Batcher
from kembed.engine.buckets import BucketQueue
from kembed.engine.intake import Intake, Work
from kembed.engine.jobs import Jobs
from kembed.engine.responder import Responder
from kembed.engine.work import Batch
from kembed.engine.worker import Engine, LoadModel, Outcome, Worker
from kembed.ipc import (
    BOARD_FILE,
    ENGINE_SOCKET,
    Board,
    Kind,
    ServingInfo,
    Slot,
    encode_json,
    receive,
    send,
)
from kembed.metrics import EngineMetrics

log = logging.getLogger(__name__)

FATAL_EXIT_CODE = 70
STARTUP_FAILED_EXIT_CODE = 1
DRAIN_GRACE_S = 5.0  # past the drain budget, for front ends to close their links
TICK_S = 0.1  # board refresh (P95, shedding) and heartbeat; idle cost is negligible at 10 Hz
MIB = 1024 * 1024
# Answers a front end may leave unread before the engine stops reading its work: about 200 ms of
# the GPU target's whole output (25,000 embeddings/s), minutes of a CPU's (README, "Choices").
LINK_HIGH_WATER = 8 * MIB


class Links:
    """The connected front ends, by link id: the engine's :class:`~kembed.engine.responder.Outbox`."""

    def __init__(self) -> None:
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._next = 0
        self._none = asyncio.Event()
        self._none.set()

    def add(self, writer: asyncio.StreamWriter) -> int:
        self._next += 1
        self._writers[self._next] = writer
        self._none.clear()
        return self._next

    def remove(self, link: int) -> None:
        self._writers.pop(link, None)
        if not self._writers:
            self._none.set()

    async def wait_none(self) -> None:
        """Until every front end has gone (each closes its link once it has drained)."""
        await self._none.wait()

    def ready(self, link: int, info: ServingInfo) -> None:
        self._send(link, Kind.READY, info.to_json())

    def result(
        self, link: int, started: float, seconds: float, tags: np.ndarray, slots: np.ndarray, embeddings: np.ndarray
    ) -> None:
        timing = np.array([started, seconds], dtype="<f8")
        rows = embeddings.astype("<f4", copy=False)  # already float32 from the worker: no copy
        self._send(link, Kind.RESULT, timing, tags.astype("<u8", copy=False), slots.astype("<u4", copy=False), rows)

    def errors(self, link: int, errors: list[tuple[int, str, str, int]]) -> None:
        self._send(link, Kind.ERRORS, encode_json(errors))

    def ids(self) -> list[int]:
        return list(self._writers)

    def _send(self, link: int, kind: Kind, *parts: np.ndarray | str) -> None:
        writer = self._writers.get(link)
        if writer is not None and not writer.is_closing():
            send(writer, kind, *parts)


@dataclass
class Core:
    """Everything a request meets in the engine once the model is warm: built once, never half-built."""

    info: ServingInfo
    load: MeasuredLoad
    batcher: Batcher
    jobs: Jobs
    intake: Intake
    responder: Responder

    @classmethod
    def build(cls, settings: Settings, worker: Worker, engine: Engine, links: Links, metrics: EngineMetrics) -> Core:
        plan, model = engine.plan, engine.model
        load = MeasuredLoad(settings)
        load.rate.seed(engine.warmup_tokens, engine.warmup_seconds)
        admission = AdmissionController(settings, load)
        batcher = Batcher(
            BucketQueue(plan.bucket_lengths),
            plan.shapes,
            worker.submit,
            max_wait=settings.max_wait_ms / 1000,
            naive=plan.naive,
        )
        jobs = Jobs(batcher)
        intake = Intake(admission, batcher, jobs, links, metrics, model.info.pad_token_id)
        responder = Responder(batcher, load.rate, jobs, links, metrics)
        return cls(_serving_info(engine), load, batcher, jobs, intake, responder)


def _serving_info(engine: Engine) -> ServingInfo:
    info, plan = engine.model.info, engine.plan
    return ServingInfo(
        model_id=info.model_id,
        dimensions=info.dimensions,
        max_input_tokens=info.max_input_tokens,
        vocab_size=info.vocab_size,
        pad_token_id=info.pad_token_id,
        pooling=info.pooling,
        excluded_token_ids=list(info.excluded_token_ids),
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        dtype=str(info.dtype).removeprefix("torch."),
        device=str(info.device),
        bucket_lengths=list(plan.bucket_lengths),
        batch_sizes=list(plan.shapes.sizes),
        tokenizer_json=engine.model.tokenizer.to_json(),
    )


class EngineProcess:
    def __init__(self, settings: Settings, runtime: Path, load_model: LoadModel) -> None:
        self._settings = settings
        self._runtime = runtime
        self._load_model = load_model
        self._board = Board(runtime / BOARD_FILE)
        self._links = Links()
        self._metrics = EngineMetrics()
        self._core: Core | None = None  # the one Optional: None until warm, then set once
        self._stop = asyncio.Event()
        self._parent = os.getppid()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; a terminal's ^C reaches all
        worker = Worker(self._settings, loop, self._fatal, self._load_model)
        server = await asyncio.start_unix_server(self._serve_link, path=str(self._runtime / ENGINE_SOCKET))
        worker.start()
        ticker = asyncio.create_task(self._tick(worker))
        waiting: set[asyncio.Future[Any]] = {worker.warm, asyncio.ensure_future(self._stop.wait())}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not worker.warm.done():
            return 0  # stopped while warming up
        if worker.engine is None:
            log.error("start-up failed: %s", worker.error)
            return STARTUP_FAILED_EXIT_CODE
        core = self._open(worker, worker.engine)
        batcher = asyncio.create_task(core.batcher.run())
        batcher.add_done_callback(self._batcher_stopped)
        await self._stop.wait()
        await self._finish()
        for task in (batcher, ticker):
            task.cancel()
        worker.stop()
        server.close()
        return 0

    def _open(self, worker: Worker, engine: Engine) -> Core:
        """Build the serving path, publish it, and tell every front end."""
        core = Core.build(self._settings, worker, engine, self._links, self._metrics)

        def deliver(batch: Batch, outcomes: list[Outcome], started: float, seconds: float) -> None:
            core.responder.deliver(batch, outcomes, started, seconds)
            self._publish(core)  # the backlog just shrank: front ends admit against it at once

        worker.serve(deliver)
        self._core = core
        self._publish(core)
        self._board[Slot.DIMENSIONS] = core.info.dimensions
        self._board[Slot.ENGINE_READY] = 1.0
        for link in self._links.ids():
            self._links.ready(link, core.info)
        # Everything loaded so far lives as long as the process: out of the collector's sight.
        gc.collect()
        gc.freeze()
        return core

    async def _finish(self) -> None:
        """Serve until every front end has drained and gone. The supervisor stops the engine only
        after them, but a SIGTERM sent to the whole process group reaches it at the same moment."""
        try:
            await asyncio.wait_for(self._links.wait_none(), self._settings.drain_timeout_s + DRAIN_GRACE_S)
        except TimeoutError:
            log.warning("stopping while %d front ends are still connected", len(self._links.ids()))

    async def _serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.set_write_buffer_limits(high=LINK_HIGH_WATER)
        link = self._links.add(writer)
        try:
            hello = await receive(reader)
            log.debug("front end %s connected as link %d", hello.json(0).get("index"), link)
            if self._core is not None:
                self._links.ready(link, self._core.info)
            while True:
                await self._until_read(link, writer)
                frame = await receive(reader)
                core = self._core
                if frame.kind is Kind.WORK and core is not None:
                    core.intake.accept(link, Work.decode(frame))
                    self._publish(core)
        except ConnectionError:  # LinkClosed, or gone while its answers waited to be read
            pass
        finally:
            self._links.remove(link)
            if self._core is not None:
                self._core.jobs.drop_link(link)
            writer.close()

    async def _until_read(self, link: int, writer: asyncio.StreamWriter) -> None:
        """A front end that leaves more than LINK_HIGH_WATER of answers unread is not read from until
        it has read most of them: what the engine holds for it stays bounded (its queued work's
        answers at most), and its callers wait, as they would on any stalled process."""
        unread = writer.transport.get_write_buffer_size()
        if unread <= LINK_HIGH_WATER:
            return
        self._metrics.frontend_stalls.inc()
        log.warning("link %d: %.0f MiB of answers unread; its new work waits until it reads them", link, unread / MIB)
        await writer.drain()
        log.info("link %d: answers read, taking its work again", link)

    def _publish(self, core: Core) -> None:
        board = self._board
        board[Slot.BACKLOG_TOKENS] = core.batcher.backlog_tokens
        board[Slot.TOKENS_PER_SECOND] = core.load.tokens_per_second
        board[Slot.IN_FLIGHT_BATCHES] = core.batcher.in_flight
        board[Slot.OPEN_REQUESTS] = len(core.jobs)

    async def _tick(self, worker: Worker) -> None:
        """Heartbeat, P95 and shedding on the board; exit if the supervisor is gone."""
        while True:
            core = self._core
            now = time.monotonic()
            # Once warm, a worker stuck in a batch stops the heartbeat: the pod is restarted.
            self._board[Slot.ENGINE_HEARTBEAT] = worker.heartbeat if core else now
            if core is not None:
                self._publish(core)
                self._board[Slot.P95_SECONDS] = core.load.p95_seconds()
                self._board[Slot.SHED_FRACTION] = core.load.shed_fraction()
            if os.getppid() != self._parent:
                log.critical("the supervisor is gone: exiting")
                os._exit(FATAL_EXIT_CODE)
            await asyncio.sleep(TICK_S)

    def _batcher_stopped(self, task: asyncio.Task[None]) -> None:
        """The batcher only ends by cancellation; anything else is a bug that would hang every request."""
        if not task.cancelled() and task.exception() is not None:
            self._fatal(task.exception() or RuntimeError("batcher stopped"))

    def _fatal(self, error: BaseException) -> None:
        """The device is poisoned (or the engine is broken): exit so the pod restarts."""
        log.critical("engine failed: %s; exiting with %d", error, FATAL_EXIT_CODE)
        self._board[Slot.ENGINE_READY] = 0.0
        os._exit(FATAL_EXIT_CODE)
