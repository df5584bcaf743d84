"""The engine process: it owns the model (on the worker thread), the global queue and the answers.

It listens on a Unix socket at once, so front ends connect while the model loads and warms up.
When warm it builds the serving path once (:class:`Core`, the composition root), publishes the
board's first state, and every link tells its front end READY. It exits when the supervisor says so (SIGTERM,
once every front end has drained), when its parent dies, or with EXIT_FATAL when the device fails
or a link breaks the protocol, so the supervisor takes the whole server down and Kubernetes restarts
the pod.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from kembed.config.settings import Settings
from kembed.contract import EXIT_FATAL, EXIT_STARTUP_FAILED
from kembed.domain.errors import EmbedError
from kembed.engine.batcher import Batcher, BatchPolicy
from kembed.engine.buckets import BucketQueue
from kembed.engine.cpu_compile import Served
from kembed.engine.intake import Intake
from kembed.engine.jobs import Jobs
from kembed.engine.model import ModelInfo
from kembed.engine.responder import Responder
from kembed.engine.runner import LoadModel, ModelRunner
from kembed.engine.units import Batch, Computed, Outcome
from kembed.engine.worker import Worker
from kembed.ipc.board import Board, Cell, ClassCell, FrontendCell
from kembed.ipc.protocol import (
    PROTOCOL_VERSION,
    Errors,
    Hello,
    Message,
    ProtocolError,
    Ready,
    Result,
    ServingInfo,
    Work,
    check_version,
    receive,
    send,
)
from kembed.metrics import EngineMetrics
from kembed.plumbing.child import Child
from kembed.plumbing.runtime import BOARD_FILE, ENGINE_SOCKET, write_serving
from kembed.policy.admission import AdmissionController
from kembed.policy.load import MeasuredLoad
from kembed.policy.priority import Priority

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 5.0  # past the drain budget, for front ends to close their links
TICK_S = 0.1  # board refresh (P95, shedding) and heartbeat; idle cost is negligible at 10 Hz
MIB = 1024 * 1024
# Answers a front end may leave unread before the engine stops reading its work: about 200 ms of
# the GPU target's whole output (25,000 embeddings/s), minutes of a CPU's (docs/decisions/backpressure.md).
LINK_HIGH_WATER = 8 * MIB


class Links:
    """The connected front ends, by link id: the engine's :class:`~kembed.engine.responder.Replies`."""

    def __init__(self) -> None:
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._next = 0
        self._none = asyncio.Event()
        self._none.set()

    def __len__(self) -> int:
        return len(self._writers)

    def add(self, writer: asyncio.StreamWriter) -> int:
        self._next += 1
        self._writers[self._next] = writer
        self._none.clear()
        return self._next

    def remove(self, link_id: int) -> None:
        self._writers.pop(link_id, None)
        if not self._writers:
            self._none.set()

    async def wait_none(self) -> None:
        """Until every front end has gone (each closes its link once it has drained)."""
        await self._none.wait()

    def send(self, link_id: int, message: Message) -> None:
        writer = self._writers.get(link_id)
        if writer is not None and not writer.is_closing():
            send(writer, message)

    def result(self, link_id: int, result: Result) -> None:
        self.send(link_id, result)

    def errors(self, link_id: int, tags: list[int], errors: list[EmbedError]) -> None:
        self.send(link_id, Errors(tags, errors))


@dataclass
class Core:
    """Everything a request meets in the engine once the model is warm: built once, never half-built."""

    info: ServingInfo
    load: MeasuredLoad
    admission: AdmissionController
    batcher: Batcher
    jobs: Jobs
    intake: Intake
    responder: Responder

    @classmethod
    def build(
        cls, settings: Settings, worker: Worker, runner: ModelRunner, links: Links, metrics: EngineMetrics
    ) -> Core:
        plan, model = runner.plan, runner.model
        load = MeasuredLoad(settings, batch_tokens=plan.shapes.max_tokens)
        load.rate.seed(runner.warmup_tokens, runner.warmup_seconds)
        admission = AdmissionController(settings, load)
        queue = BucketQueue(plan.bucket_lengths)
        jobs = Jobs(queue)
        policy = BatchPolicy(
            plan.shapes,
            max_wait=settings.max_wait_ms / 1000,
            starved_after=settings.max_drain_ms / 1000,
            packed=plan.packed,
            overhead_tokens=runner.overhead_tokens,
            lanes=plan.lanes,
        )
        batcher = Batcher(queue, policy, worker.submit, expire=jobs.expire)
        intake = Intake(admission, load, batcher, jobs, links, metrics, model.info.pad_token_id)
        responder = Responder(batcher, load.rate, jobs, links, metrics, lanes=plan.lanes)
        return cls(_serving_info(runner), load, admission, batcher, jobs, intake, responder)


# What front ends learn of the model as it is (the torch-typed dtype and device go as names).
_MODEL_FIELDS = sorted(
    {f.name for f in fields(ServingInfo)} & {f.name for f in fields(ModelInfo)} - {"dtype", "device"}
)


def _serving_info(runner: ModelRunner) -> ServingInfo:
    info, plan = runner.model.info, runner.plan
    return ServingInfo(
        **{name: getattr(info, name) for name in _MODEL_FIELDS},
        dtype=runner.precision.dtype,
        device=str(info.device),
        bucket_lengths=list(plan.bucket_lengths),
        batch_sizes=list(plan.shapes.sizes),
        tokenizer_json=runner.model.tokenizer.to_json(),
    )


class EngineProcess:
    def __init__(self, settings: Settings, runtime: Path, load_model: LoadModel) -> None:
        self._settings = settings
        self._runtime = runtime
        self._load_model = load_model
        self._board = Board(runtime / BOARD_FILE)
        self._links = Links()
        self._metrics = EngineMetrics()
        self._child = Child()
        self._expiry: asyncio.TimerHandle | None = None  # at the earliest deadline of an open job
        self._dtype: dict[str, str] = {}  # what the serving file says of the dtype, once warm
        self._forward: Served | None = None  # the forward that serves, once warm

    async def run(self) -> int:
        self._child.handle_signals()
        loop = asyncio.get_running_loop()
        serving: asyncio.Future[Core] = loop.create_future()  # front ends that connect early wait on it
        worker = Worker(self._settings, loop, self._fatal, self._load_model, self._served)
        server = await asyncio.start_unix_server(
            lambda reader, writer: self._serve_link(reader, writer, serving), path=str(self._runtime / ENGINE_SOCKET)
        )
        worker.start()
        ticker = asyncio.create_task(self._child.tick(TICK_S, self._beat_while_warming))
        stopped = asyncio.ensure_future(self._child.stop.wait())
        waiting: set[asyncio.Future[Any]] = {worker.warm, stopped}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        ticker.cancel()
        if not worker.warm.done():
            return 0  # stopped while warming up
        try:
            runner = worker.warm.result()
        except Exception as error:
            log.error("start-up failed: %s", error)
            return EXIT_STARTUP_FAILED
        core = self._open(worker, runner)
        serving.set_result(core)
        ticker = asyncio.create_task(self._child.tick(TICK_S, lambda: self._beat(worker, core)))
        batcher = asyncio.create_task(core.batcher.run())
        batcher.add_done_callback(self._batcher_stopped)
        await stopped
        await self._finish()
        for task in (batcher, ticker):
            task.cancel()
        worker.stop()
        server.close()
        return 0

    def _open(self, worker: Worker, runner: ModelRunner) -> Core:
        """Build the serving path and publish it; front ends hear READY from their links."""
        core = Core.build(self._settings, worker, runner, self._links, self._metrics)

        def deliver(batch: Batch, outcomes: list[Outcome], computed: Computed) -> None:
            core.responder.deliver(batch, outcomes, computed)
            self._publish(core)  # the backlog just shrank: front ends admit against it at once

        worker.serve(deliver)
        precision = runner.precision
        self._metrics.serving_dtype.labels(dtype=precision.dtype, reason=precision.why).set(1)
        self._dtype = {"dtype": precision.dtype, "dtype_reason": precision.why}
        self._served(runner.served)
        self._publish(core)
        self._board[Cell.DIMENSIONS] = core.info.dimensions
        self._board[Cell.ENGINE_READY] = 1.0
        self._child.freeze_heap()
        return core

    def _served(self, served: Served) -> None:
        """Say which forward serves, and why: at readiness, and again when a compile beside serving ends
        (the gauge then reads 0 for the forward served before: a multiprocess gauge keeps its series)."""
        if self._forward is not None:
            self._metrics.serving_forward.labels(forward=self._forward.forward, reason=self._forward.why).set(0)
        self._forward = served
        self._metrics.serving_forward.labels(forward=served.forward, reason=served.why).set(1)
        write_serving(self._runtime, {**self._dtype, "forward": served.forward, "forward_reason": served.why})

    async def _finish(self) -> None:
        """Serve until every front end has drained and gone. The supervisor stops the engine only
        after them, but a SIGTERM sent to the whole process group reaches it at the same moment."""
        try:
            await asyncio.wait_for(self._links.wait_none(), self._settings.drain_timeout_s + DRAIN_GRACE_S)
        except TimeoutError:
            log.warning("stopping while %d front ends are still connected", len(self._links))

    async def _serve_link(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, serving: asyncio.Future[Core]
    ) -> None:
        writer.transport.set_write_buffer_limits(high=LINK_HIGH_WATER)
        link_id = self._links.add(writer)
        core: Core | None = None
        try:
            hello = _expect(await receive(reader), Hello)
            check_version(hello.version)
            if not 0 <= hello.frontend < self._board.frontends:  # its acknowledgements would land nowhere
                raise ProtocolError(f"HELLO from front end {hello.frontend}, of {self._board.frontends}")
            log.debug("front end %d connected as link %d", hello.frontend, link_id)
            core = await serving
            self._links.send(link_id, Ready(PROTOCOL_VERSION, core.info))
            taken = 0
            while True:
                await self._until_read(link_id, writer)
                core.intake.accept(link_id, _expect(await receive(reader), Work))
                self._publish(core)
                self._arm_expiry(core)
                taken += 1  # after the publish: the front end counts a frame's work until the board does
                self._board.set_frontend(hello.frontend, FrontendCell.FRAMES_TAKEN, taken)
        except ConnectionError:  # LinkClosed, or gone while its answers waited to be read
            pass
        except ProtocolError as error:  # never worked around: the pod restarts rather than compute wrong rows
            self._fatal(error)
        finally:
            self._links.remove(link_id)
            if core is not None:
                core.jobs.drop_link(link_id)
            writer.close()

    async def _until_read(self, link_id: int, writer: asyncio.StreamWriter) -> None:
        """A front end that leaves more than LINK_HIGH_WATER of answers unread is not read from until
        it has read most of them: what the engine holds for it stays bounded (its queued work's
        answers at most), and its callers wait, as they would on any stalled process."""
        unread = writer.transport.get_write_buffer_size()
        if unread <= LINK_HIGH_WATER:
            return
        self._metrics.frontend_stalls.inc()
        log.warning(
            "link %d: %.0f MiB of answers unread; its new work waits until it reads them", link_id, unread / MIB
        )
        await writer.drain()
        log.info("link %d: answers read, taking its work again", link_id)

    def _arm_expiry(self, core: Core) -> None:
        """A timer at the earliest deadline of an open job, unless one is set for sooner."""
        due = core.jobs.next_deadline()
        if due is None or (self._expiry is not None and self._expiry.when() <= due):
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_at(due, self._expire, core)

    def _expire(self, core: Core) -> None:
        """Close the jobs whose deadlines passed (their front ends answer them), so that the
        backlog front ends admit against stops counting them at once."""
        self._expiry = None
        if core.jobs.expire_due(time.monotonic()):
            self._publish(core)
        self._arm_expiry(core)

    def _publish(self, core: Core) -> None:
        board, backlog, queue = self._board, core.intake.backlog(), core.batcher.queue
        board[Cell.BACKLOG_TOKENS] = backlog.total
        board[Cell.IN_FLIGHT_TOKENS] = backlog.in_flight
        board[Cell.IN_FLIGHT_INTERACTIVE_TOKENS] = backlog.in_flight_interactive
        board[Cell.DISPLACEABLE_TOKENS] = backlog.displaceable
        board.set_class(Priority.INTERACTIVE, ClassCell.LAPSING_TOKENS, backlog.interactive_lapsing)
        board.set_class(Priority.BATCH, ClassCell.LAPSING_TOKENS, backlog.batch_lapsing)
        for priority in Priority:
            board.set_class(priority, ClassCell.QUEUED_TOKENS, queue.tokens(priority))
            board.set_class(priority, ClassCell.WAITING_REQUESTS, queue.waiting(priority))
        board[Cell.TOKENS_PER_SECOND] = core.load.tokens_per_second
        board[Cell.SATURATION] = core.admission.saturation(backlog)
        board[Cell.IN_FLIGHT_BATCHES] = core.batcher.in_flight
        board[Cell.OPEN_REQUESTS] = len(core.jobs)

    def _beat_while_warming(self) -> None:
        """Warmup may compile for minutes between shapes: alive is all the board can say."""
        self._board[Cell.ENGINE_HEARTBEAT] = time.monotonic()

    def _beat(self, worker: Worker, core: Core) -> None:
        """The worker's heartbeat (a batch stuck on the device stops it: the pod is restarted), P95
        and shedding."""
        self._board[Cell.ENGINE_HEARTBEAT] = worker.heartbeat
        self._board[Cell.CAPACITY] = core.load.capacity()
        self._publish(core)
        for priority in Priority:
            self._board.set_class(priority, ClassCell.P95_SECONDS, core.load.p95_seconds(priority))
        self._board[Cell.SHED_FRACTION] = core.load.shed_fraction()

    def _batcher_stopped(self, task: asyncio.Task[None]) -> None:
        """The batcher only ends by cancellation; anything else is a bug that would hang every request."""
        if not task.cancelled() and task.exception() is not None:
            self._fatal(task.exception() or RuntimeError("batcher stopped"))

    def _fatal(self, error: BaseException) -> None:
        """The device is poisoned, or the engine is broken: exit so the pod restarts."""
        log.critical("engine failed: %s; exiting with %d", error, EXIT_FATAL)
        self._board[Cell.ENGINE_READY] = 0.0
        os._exit(EXIT_FATAL)


M = TypeVar("M", Hello, Work)


def _expect(message: Message, kind: type[M]) -> M:
    if not isinstance(message, kind):
        raise ProtocolError(f"expected {kind.kind.name}, got {message.kind.name}")
    return message
