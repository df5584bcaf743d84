"""A front-end process: one of ``KEMBED_FRONTENDS`` gRPC servers sharing the port (SO_REUSEPORT).

It listens at once, answering UNAVAILABLE, while it connects to the engine; when the engine says
READY it builds the serving path once (the composition root) and turns SERVING. On SIGTERM it stops
admitting, answers everything it accepted, and exits 0. If the engine goes away it exits non-zero.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # no stub
from grpc_reflection.v1alpha import reflection

from kembed import tls
from kembed.config import Settings
from kembed.contract import GRPC_SERVICE
from kembed.frontend.link import EngineLink
from kembed.frontend.screen import Screen
from kembed.frontend.service import EmbedderServicer, EmbedService, Gate
from kembed.ipc import BOARD_FILE, FRONTEND_SERVING, Board, LinkClosed, Slot
from kembed.metrics import FrontendMetrics
from kembed.v1 import embedder_pb2, embedder_pb2_grpc

log = logging.getLogger(__name__)

ENGINE_LOST_EXIT_CODE = 70
TICK_S = 1.0
TOKENIZER_THREADS = 2


class FrontendProcess:
    def __init__(self, settings: Settings, runtime: Path, index: int) -> None:
        self._settings = settings
        self._runtime = runtime
        self._index = index
        self._board = Board(runtime / BOARD_FILE)
        self._metrics = FrontendMetrics()
        self._gate = Gate(lambda: self._board[Slot.DRAINING] == 1.0)
        self._servicer = EmbedderServicer(self._metrics, self._gate)
        self._health = health_aio.HealthServicer()
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kembed-tokenize")
        self._stop = asyncio.Event()
        self._parent = os.getppid()
        self._grpc = grpc.aio.server(
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
            options=[
                ("grpc.so_reuseport", 1),
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                ("grpc.max_connection_age_ms", settings.max_connection_age_ms),
                ("grpc.max_connection_age_grace_ms", int(settings.drain_timeout_s * 1000)),
            ],
        )

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; a terminal's ^C reaches all
        await self._listen()
        ticker = asyncio.create_task(self._tick())
        frame_interval = self._settings.frame_interval_ms / 1000
        connect = asyncio.create_task(EngineLink.connect(self._runtime, self._index, frame_interval))
        stopped = asyncio.create_task(self._stop.wait())
        await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():
            connect.cancel()
            await self._grpc.stop(0)
            return 0
        try:
            link = connect.result()
        except LinkClosed as error:
            log.critical("no engine: %s", error)
            return ENGINE_LOST_EXIT_CODE
        routing = asyncio.create_task(link.run())
        await self._open(link)
        await asyncio.wait({routing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if routing.done():
            log.critical("lost the engine: %s", routing.exception())
            return ENGINE_LOST_EXIT_CODE
        await self._drain()
        routing.cancel()
        ticker.cancel()
        link.close()
        return 0

    async def _listen(self) -> None:
        embedder_pb2_grpc.add_EmbedderServicer_to_server(self._servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        service_names = (
            embedder_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(service_names, self._grpc)
        tls.add_port(self._grpc, f"{self._settings.grpc_host}:{self._settings.grpc_port}", self._settings)
        await self._set_serving(False)
        await self._grpc.start()

    async def _open(self, link: EngineLink) -> None:
        """The engine is warm: build the serving path and start answering."""
        screen = Screen(self._settings, self._board, link)
        self._servicer.service = EmbedService(self._settings, link, screen, self._gate, self._metrics, self._executor)
        await self._set_serving(True)
        self._board.set_frontend(self._index, FRONTEND_SERVING, 1.0)
        # What is loaded now lives as long as the process: out of the collector's sight, so full
        # collections stop walking it between requests.
        gc.collect()
        gc.freeze()

    async def _drain(self) -> None:
        """Stop taking work, answer everything accepted, then stop listening."""
        self._gate.draining = True
        if isinstance(self._servicer.service, EmbedService):
            self._servicer.service.release_held()
        self._board.set_frontend(self._index, FRONTEND_SERVING, 0.0)
        await self._set_serving(False)
        log.info("draining: %d requests in progress", self._gate.active)
        try:
            await asyncio.wait_for(self._gate.wait_idle(), self._settings.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out with %d requests in progress", self._gate.active)
        await self._grpc.stop(1.0)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GRPC_SERVICE):
            await self._health.set(service, status)

    async def _tick(self) -> None:
        """The event loop's heartbeat for /livez; exit if the supervisor is gone."""
        while True:
            self._board.beat_frontend(self._index)
            if os.getppid() != self._parent:
                log.critical("the supervisor is gone: exiting")
                os._exit(ENGINE_LOST_EXIT_CODE)
            await asyncio.sleep(TICK_S)
