"""The model's own threads: the first loads and warms up the model (:mod:`kembed.engine.warmup`),
then it and its sibling lanes compute batches; on a CPU, one more compiles the forward meanwhile.

One thread owns the model because CUDA graphs captured by ``torch.compile(mode="reduce-overhead")``
live in thread-local state: the thread that warms up is the thread that replays. It never touches
asyncio objects; each finished batch goes back in one ``loop.call_soon_threadsafe`` call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from kembed.config.settings import Settings
from kembed.engine import cpu, cpu_compile
from kembed.engine.cpu_compile import Served
from kembed.engine.model import EmbeddingModel
from kembed.engine.runner import LoadModel, ModelRunner
from kembed.engine.units import Batch, Computed, Deliver
from kembed.engine.warmup import compile_while_serving, compiles_while_serving, start_runner

log = logging.getLogger(__name__)

SPARE_POLL_S = 1.0  # how often the compile thread looks whether the pod has CPU to spare


class Worker:
    """The threads around the ModelRunner. The first loads and warms up at once: ``warm`` resolves to
    the ModelRunner, or to the error that stopped it. Batches flow once ``serve`` hands it the way back,
    to as many lanes as the plan computes at once (the first thread and its siblings), each taking the
    next batch when free. Once warm, a lane that ends other than by ``stop`` tells ``on_fatal`` why, on
    the loop."""

    def __init__(
        self,
        settings: Settings,
        loop: asyncio.AbstractEventLoop,
        on_fatal: Callable[[BaseException], None],
        load_model: LoadModel = EmbeddingModel.load,
        on_served: Callable[[Served], None] = lambda _: None,
    ) -> None:
        self._settings = settings
        self._loop = loop
        self._on_fatal = on_fatal
        self._on_served = on_served
        self._load_model = load_model
        self._batches: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._way_back: queue.SimpleQueue[Deliver | None] = queue.SimpleQueue()  # None: stopped before serving
        self._thread = threading.Thread(target=self._main, name="kembed-worker", daemon=True)
        self._lanes = 1
        self.warm: asyncio.Future[ModelRunner] = loop.create_future()
        self.heartbeat = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def serve(self, deliver: Deliver) -> None:
        """Start computing batches; each result goes to ``deliver`` on the event loop."""
        self._way_back.put(deliver)

    def submit(self, batch: Batch) -> None:
        self._batches.put(batch)

    def stop(self) -> None:
        for _ in range(self._lanes):
            self._batches.put(None)
        self._way_back.put(None)

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def _main(self) -> None:
        try:
            runner = start_runner(self._settings, self._load_model, self._beat)
        except BaseException as error:  # reported to the engine process, which exits non-zero
            log.exception("model start-up failed")
            self._loop.call_soon_threadsafe(self._resolve_warm, None, error)
            return
        self._lanes = runner.plan.lanes  # before warm resolves: stop() puts one None per lane
        self._loop.call_soon_threadsafe(self._resolve_warm, runner, None)
        deliver = self._way_back.get()
        if deliver is None:
            return
        threads = cpu.lane_threads(self._settings.cpus(), self._lanes)
        if self._lanes > 1:
            log.info("computing %d batches at once, each on %d compute thread(s)", self._lanes, threads)
        for lane in range(1, self._lanes):  # created here, they inherit the compute threads' niceness
            name = f"kembed-worker-{lane}"
            threading.Thread(target=self._lane, args=(runner, deliver, lane, threads), name=name, daemon=True).start()
        if compiles_while_serving(self._settings, runner):  # on idle CPU only: admitted work goes first
            threading.Thread(target=self._compile, args=(runner,), name="kembed-compile", daemon=True).start()
        self._lane(runner, deliver, 0, threads)

    def _compile(self, runner: ModelRunner) -> None:
        """Compile the forward beside eager serving, once the pod has CPU to spare and then on CPU
        time serving leaves idle; ``on_served`` hears which serves, on the loop."""
        self._wait_for_spare_cpu()
        log.info("compiling the forward beside serving at %s", cpu.only_when_idle())
        try:
            with cpu.switching_often(cpu.COMPILE_SWITCH_INTERVAL_S):
                served = compile_while_serving(self._settings, runner)
        except BaseException as error:  # a bug, not the compile's own failure: eager serves on
            log.exception("the compile thread failed; eager serves")
            served = runner.served = cpu_compile.failed(error)
        self._loop.call_soon_threadsafe(self._on_served, served)

    def _wait_for_spare_cpu(self) -> None:
        """Until the pod's CPUs (the container's, else the machine's) have been idle a share of a
        window, or for at most ``SPARE_MAX_WAIT_S``."""
        used, own = cpu.cpu_seconds_used()
        spare = cpu_compile.SpareCpu(self._settings.cpus() if own else float(os.cpu_count() or 1))
        started = time.monotonic()
        scope = "the container" if own else "the machine"
        share, window = cpu_compile.SPARE_SHARE, cpu_compile.SPARE_WINDOW_S
        log.info("the forward compiles once %s's CPUs are %.0f%% idle over %.0f s", scope, 100 * share, window)
        while not spare.spare(used, now := time.monotonic()) and now - started < cpu_compile.SPARE_MAX_WAIT_S:
            time.sleep(SPARE_POLL_S)
            used, _ = cpu.cpu_seconds_used()

    def _resolve_warm(self, runner: ModelRunner | None, error: BaseException | None) -> None:
        if self.warm.done():
            return
        if runner is not None:
            self.warm.set_result(runner)
        else:
            self.warm.set_exception(error or RuntimeError("start-up failed"))

    def _lane(self, runner: ModelRunner, deliver: Deliver, lane: int, threads: int) -> None:
        try:
            if self._lanes > 1:
                cpu.enter_lane(threads)
            self._serve(runner, deliver, lane)
        except BaseException as error:  # a device error, or a bug: either way no batch is computed again
            log.critical("worker thread failed, exiting: %r", error, exc_info=True)
            self._loop.call_soon_threadsafe(self._on_fatal, error)

    def _serve(self, runner: ModelRunner, deliver: Deliver, lane: int) -> None:
        while True:
            try:
                batch = self._batches.get(timeout=1.0)  # the timeout only refreshes the heartbeat
            except queue.Empty:
                self._beat()
                continue
            if batch is None:
                return
            self.heartbeat = started = time.monotonic()
            outcomes = runner.compute(batch.live_chunks(), batch.seq_len)  # raises only what is fatal
            computed = Computed(lane, started, time.monotonic() - started)
            self._beat()
            self._loop.call_soon_threadsafe(deliver, batch, outcomes, computed)
