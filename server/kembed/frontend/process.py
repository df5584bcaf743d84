"""A front-end process: one of ``KEMBED_FRONTENDS`` servers sharing the gRPC and REST ports
(SO_REUSEPORT).

It listens at once, answering UNAVAILABLE, while it connects to the engine; when the engine says
READY it builds the serving path once (the composition root) and turns SERVING. On SIGTERM it stops
admitting, answers everything it accepted, and exits 0. If the engine goes away, or its link breaks
the protocol, it exits EXIT_FATAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kembed.config.settings import Settings
from kembed.contract import EXIT_FATAL
from kembed.frontend import budget
from kembed.frontend.gate import Gate
from kembed.frontend.grpc_api import GrpcEdge
from kembed.frontend.link import EngineLink
from kembed.frontend.pushback import PacedAnswers, RefusalPacer
from kembed.frontend.rest import RestEdge, raise_fd_limit
from kembed.frontend.screen import Screen
from kembed.frontend.service import EmbedService, Service, WarmingUp
from kembed.ipc.board import Board, Cell, FrontendCell
from kembed.ipc.protocol import LinkClosed, ProtocolError
from kembed.metrics import FrontendMetrics
from kembed.plumbing.child import Child
from kembed.plumbing.runtime import BOARD_FILE

log = logging.getLogger(__name__)

TICK_S = 1.0
TOKENIZER_THREADS = 2
MAX_NICE = 19


def below_serving(nice: int) -> None:
    """Run this thread (a tokenizing one) ``nice`` levels below the event loop, as the engine's
    compute threads run (``docs/decisions/compute-nice.md``): a large call's tokenizing is compute,
    and at the event loop's priority a client's large bodies took the cores from the compute
    (niced) and from everyone's calls (a bystander's calls/s fell 10 times)."""
    main = threading.main_thread().native_id or os.getpid()
    target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, main) + nice)
    with contextlib.suppress(OSError):  # a container that forbids it: serving goes on at its priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)


class FrontendProcess:
    def __init__(self, settings: Settings, runtime: Path, index: int) -> None:
        self._settings = settings
        self._runtime = runtime
        self._index = index
        self._board = Board(runtime / BOARD_FILE)
        self._metrics = FrontendMetrics()
        self._gate = Gate(lambda: self._board[Cell.DRAINING] == 1.0)
        self._service: Service = WarmingUp()  # replaced, once, when the engine is warm
        pacer = RefusalPacer(settings.refusal_rate, settings.refusal_burst, on_shared=self._metrics.refusals_shared.inc)
        self._paced = PacedAnswers(pacer, on_paced=self._metrics.refusals_paced.inc)
        memory = budget.pod_memory(settings.memory_limit_bytes)
        self._budget = budget.MemoryBudget(
            budget.frontend_budget(memory, settings.frontend_count(), settings.max_message_bytes)
        )
        raise_fd_limit()
        self._grpc = GrpcEdge(settings, self._metrics, self._gate, self._budget, self._paced, lambda: self._service)
        self._rest = (
            RestEdge(settings, self._metrics, self._gate, self._budget, lambda: self._service)
            if settings.rest_port
            else None
        )
        self._executor = ThreadPoolExecutor(
            TOKENIZER_THREADS,
            thread_name_prefix="kembed-tokenize",
            initializer=below_serving,
            initargs=(settings.compute_nice,),
        )
        self._child = Child()

    async def run(self) -> int:
        self._child.handle_signals()
        await self._listen()
        ticker = asyncio.create_task(self._child.tick(TICK_S, self._beat))
        frame_interval = self._settings.frame_interval_ms / 1000
        connecting = EngineLink.connect(self._runtime, self._index, frame_interval, self._frames_taken)
        connect = asyncio.create_task(connecting)
        stopped = asyncio.create_task(self._child.stop.wait())
        await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():
            connect.cancel()
            await self._grpc.stop(0)
            return 0
        try:
            link = connect.result()
        except (LinkClosed, ProtocolError) as error:
            log.critical("no engine: %s", error)
            return EXIT_FATAL
        routing = asyncio.create_task(link.run())
        await self._open(link)
        await asyncio.wait({routing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if routing.done():
            log.critical("lost the engine: %s", routing.exception())
            return EXIT_FATAL
        await self._drain()
        routing.cancel()
        ticker.cancel()
        link.close()
        return 0

    async def _listen(self) -> None:
        await self._grpc.start()
        rest = ""
        if self._rest is not None:
            await self._rest.start()
            rest = f", REST holds {self._rest.max_connections} connections"
        mib = self._budget.capacity // 2**20
        log.info("memory budget %d MiB; gRPC takes %d calls at once%s", mib, self._grpc.max_calls, rest)

    async def _open(self, link: EngineLink) -> None:
        """The engine is warm: build the serving path and start answering."""
        screen = Screen(self._settings, self._board, self._index, link.in_transit, link.add_refusal)
        self._service = EmbedService(
            *(self._settings, link, screen, self._gate, self._metrics),
            *(self._executor, self._budget, self._paced, self._runtime),
        )
        if self._rest is not None:
            self._rest.serve_model(link.info)
        await self._grpc.set_serving(True)
        self._board.set_frontend(self._index, FrontendCell.SERVING, 1.0)
        self._child.freeze_heap()

    async def _drain(self) -> None:
        """Stop taking work, answer everything accepted, then stop listening."""
        self._gate.draining = True
        self._paced.drain()
        if self._rest is not None:
            self._rest.drain()
        self._board.set_frontend(self._index, FrontendCell.SERVING, 0.0)
        await self._grpc.set_serving(False)
        log.info("draining: %d requests in progress", self._gate.active)
        try:
            await asyncio.wait_for(self._gate.wait_idle(), self._settings.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out with %d requests in progress", self._gate.active)
        await self._grpc.stop(1.0)
        if self._rest is not None:
            await self._rest.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _frames_taken(self) -> int:
        """The WORK frames of this front end the engine has taken: the link's clock."""
        return int(self._board.frontend(self._index, FrontendCell.FRAMES_TAKEN))

    def _beat(self) -> None:
        """The event loop's heartbeat for /livez; rotated TLS files reach the REST port."""
        self._board.beat_frontend(self._index)
        if self._rest is not None:
            self._rest.refresh_tls()
