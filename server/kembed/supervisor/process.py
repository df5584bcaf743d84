"""The supervisor: one pod, one face, over an engine process and ``KEMBED_FRONTENDS`` front ends.

It starts the engine (which loads and warms the model) and the front ends (which share the gRPC
port through SO_REUSEPORT), and serves the HTTP port itself: /livez, /readyz and /health from the
board the processes share, /metrics from every process's counters merged. Ready means the engine is
warm and every front end is serving, and not draining.

On SIGTERM it marks the board draining (readiness drops at once, and every front end refuses new
calls), tells each front end to drain, waits until they have answered everything they accepted,
then stops the engine: exit 0. If any child exits otherwise, the whole server exits non-zero at
once, so Kubernetes restarts the pod instead of leaving it half-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from asyncio.subprocess import Process
from typing import Any

from kembed.config.settings import Settings
from kembed.contract import EXIT_FATAL, Metric
from kembed.ipc.board import Board, Cell, ClassCell, FrontendCell
from kembed.metrics import drain_seconds, interactive_drain_seconds, supervisor_registry
from kembed.plumbing import listen
from kembed.plumbing.runtime import BOARD_FILE, METRICS_DIR, RuntimeDir, read_serving
from kembed.policy.priority import Priority
from kembed.supervisor.http import HealthServer
from kembed.supervisor.refusals import SAMPLE_S, WINDOW_S, RecentRefusals, counted

log = logging.getLogger(__name__)

LIVENESS_STALE_S = 60.0  # a process silent this long is stuck: let Kubernetes restart the pod
READY_POLL_S = 0.1  # only while starting: how often to look whether everyone is up
STOP_GRACE_S = 10.0  # beyond the drain budget, before a child that will not stop is killed


class Supervisor:
    def __init__(self, settings: Settings, model_loader: str | None = None) -> None:
        """Bind both ports and make the runtime folder; if any of it fails, none of it is left.
        ``model_loader`` (``module:callable``) replaces the engine's model loader (benchmarks, tests)."""
        self.settings = settings
        self.frontends = settings.frontend_count()
        self._model_loader = model_loader
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._children: list[Process] = []
        with contextlib.ExitStack() as held:
            # The API ports are bound, not listened on, so that a port in use stops the start with its
            # name, and any free port (0; REST's REST_ANY_PORT) names one for every front end.
            self.grpc_port = self._hold(held, settings.grpc_port, "gRPC", "grpc_port")
            self.rest_port = (
                self._hold(held, max(settings.rest_port, 0), "REST", "rest_port") if settings.rest_port else 0
            )
            self._runtime = held.enter_context(RuntimeDir.create()).path
            (self._runtime / METRICS_DIR).mkdir()
            self.board = Board(self._runtime / BOARD_FILE, frontends=self.frontends)
            self._registry = supervisor_registry(
                self._runtime / METRICS_DIR, self.board, self.ready, settings.demand_window_s
            )
            self._refusals = RecentRefusals(lambda: counted(self._registry))
            self.http = held.enter_context(
                HealthServer(
                    listen.bind(settings.http_host, settings.http_port, "HTTP", "http_port"),
                    live=self.live,
                    ready=self.ready,
                    health=self.health,
                    registry=self._registry,
                )
            )
            self._held = held.pop_all()  # released when run() ends

    def _hold(self, held: contextlib.ExitStack, port: int, purpose: str, setting: str) -> int:
        """Bind an API port (shared with the front ends) until run() ends; the port bound."""
        sock = held.enter_context(listen.bind(self.settings.grpc_host, port, purpose, setting, reuse_port=True))
        return int(sock.getsockname()[1])

    async def run(self) -> int:
        try:
            return await self._run()
        finally:
            await self._kill_all()
            self._held.close()

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        await self.http.start()
        loader = () if self._model_loader is None else ("--model-loader", self._model_loader)
        engine = await self._spawn("kembed.engine", *loader)
        ports = ("--grpc-port", str(self.grpc_port), "--rest-port", str(self.rest_port))
        frontends = [await self._spawn("kembed.frontend", "--index", str(i), *ports) for i in range(self.frontends)]
        s = self.settings
        plural = "s" if self.frontends > 1 else ""
        rest = f"OpenAI REST on {self._rest_url()}/v1, " if s.rest_port else ""
        print(  # the ports bound, any free one resolved: listen.listening_ports reads this line
            f"kembed: gRPC on {listen.host_port(s.grpc_host, self.grpc_port)} ({self.frontends} front end{plural}), "
            f"{rest}health and metrics on http://{listen.host_port(s.http_host, self.http.port)} "
            "(warming up; /readyz turns 200 when ready)",
            flush=True,
        )
        exits = {asyncio.create_task(child.wait()): child for child in self._children}
        stop = asyncio.create_task(self._stop.wait())
        announce = asyncio.create_task(self._announce_ready())
        sampling = asyncio.create_task(self._sample_refusals())
        done, _ = await asyncio.wait({*exits, stop}, return_when=asyncio.FIRST_COMPLETED)
        announce.cancel()
        sampling.cancel()
        if stop in done:
            log.info("signal received: draining")
            return await self._drain(engine, frontends)
        child = exits[next(iter(done - {stop}))]
        code = child.returncode or EXIT_FATAL
        log.error("child %d exited with %s: stopping the server", child.pid, child.returncode)
        return code

    async def _spawn(self, module: str, *args: str) -> Process:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self._runtime / METRICS_DIR)}
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "--runtime", str(self._runtime), *args, env=env
        )
        self._children.append(child)
        return child

    async def _drain(self, engine: Process, frontends: list[Process]) -> int:
        """Front ends answer what they accepted and exit; then the engine stops."""
        self.board[Cell.DRAINING] = 1.0
        budget = self.settings.drain_timeout_s + STOP_GRACE_S
        codes = await self._stop_all(frontends, budget)
        codes += await self._stop_all([engine], budget)
        # The pod is going: no scrape will see this counter now, so the last log line says it.
        dropped = self._registry.get_sample_value(Metric.STREAM_ANSWERS_DROPPED + "_total")
        if dropped:
            log.warning("the drain dropped %d computed stream answers that clients had not read", dropped)
        log.info("stopped")
        return next((code for code in codes if code), 0)

    async def _stop_all(self, children: list[Process], budget: float) -> list[int]:
        for child in children:
            if child.returncode is None:
                child.send_signal(signal.SIGTERM)
        try:
            return list(await asyncio.wait_for(asyncio.gather(*(c.wait() for c in children)), budget))
        except TimeoutError:
            log.error("children did not stop within %.0f s", budget)
            return [EXIT_FATAL]

    async def _kill_all(self) -> None:
        for child in self._children:
            if child.returncode is None:
                child.kill()
                await child.wait()

    async def _announce_ready(self) -> None:
        while not self.ready():  # noqa: ASYNC110  # the board is shared memory: nothing to wait on
            await asyncio.sleep(READY_POLL_S)
        tls = " --ca-file CA.crt" if self.settings.tls else ""
        print(
            f"kembed: ready. Try: .venv/bin/python -m kembed.client --target "
            f"{listen.host_port(self.settings.grpc_host, self.grpc_port)}{tls} 'hello world'",
            flush=True,
        )
        if self.settings.rest_port:
            print(
                f"kembed: or: curl {self._rest_url()}/v1/embeddings -H 'Content-Type: application/json' "
                """-d '{"input": "hello world"}'""",
                flush=True,
            )

    async def _sample_refusals(self) -> None:
        while True:
            self._refusals.sample()
            await asyncio.sleep(SAMPLE_S)

    def _rest_url(self) -> str:
        scheme = "https" if self.settings.tls else "http"
        return f"{scheme}://{listen.host_port(self.settings.grpc_host, self.rest_port)}"

    def ready(self) -> bool:
        board = self.board
        return (
            board[Cell.ENGINE_READY] == 1.0
            and board[Cell.DRAINING] == 0.0
            and all(board.frontend(i, FrontendCell.SERVING) == 1.0 for i in range(self.frontends))
        )

    def live(self) -> bool:
        """Every child runs, and none has gone silent (a heartbeat of 0: still starting)."""
        if any(child.returncode is not None for child in self._children):
            return False
        now = time.monotonic()
        beats = [self.board[Cell.ENGINE_HEARTBEAT]]
        beats += [self.board.frontend(i, FrontendCell.HEARTBEAT) for i in range(self.frontends)]
        return all(beat == 0.0 or now - beat < LIVENESS_STALE_S for beat in beats)

    def health(self) -> dict[str, Any]:
        board = self.board
        drain = drain_seconds(board)
        p95 = board.of_class(Priority.INTERACTIVE, ClassCell.P95_SECONDS)
        recent = self._refusals.recent()
        return {
            "status": self._status(drain, p95, recent.refused > 0),
            "accepting_requests": self.ready(),
            "saturated": recent.refused > 0,
            "refusals": {"window_s": WINDOW_S, "refused": int(recent.refused), "answered": int(recent.answered)},
            "queued_tokens": int(board[Cell.BACKLOG_TOKENS]),
            "service_rate_tokens_per_sec": round(board[Cell.TOKENS_PER_SECOND], 1),
            "estimated_drain_time_ms": round(drain * 1000, 1),
            "p95_server_side_latency_ms": round(p95 * 1000, 1),
            "worker_queue_depth": int(board[Cell.IN_FLIGHT_BATCHES]),
            "open_requests": int(board[Cell.OPEN_REQUESTS]),
            "waiting_requests": {p.label: int(board.of_class(p, ClassCell.WAITING_REQUESTS)) for p in Priority},
            "embedding_dimension": int(board[Cell.DIMENSIONS]) or None,
            **{
                "dtype": None,
                "dtype_reason": None,
                "forward": None,
                "forward_reason": None,
                **read_serving(self._runtime),
            },
            "frontends": self.frontends,
            "uptime_seconds": round(time.monotonic() - self.started, 1),
        }

    def _status(self, drain: float, p95: float, refusing: bool) -> str:
        """``overloaded`` when queries meet more than the drain budget of their own class's work or
        served queries' P95 is over the hard limit; ``degraded`` when some work is refused (shedding,
        or batch work over the budget); ``saturated`` when neither holds but calls were refused in
        the last ``WINDOW_S`` (a burst refused whole leaves no backlog); else ``healthy``."""
        board = self.board
        if board[Cell.DRAINING]:
            return "draining"
        if not self.ready():
            return "starting"
        budget_s = self.settings.max_drain_ms / 1000
        if interactive_drain_seconds(board) > budget_s or p95 * 1000 > self.settings.p95_hard_ms:
            return "overloaded"
        if board[Cell.SHED_FRACTION] > 0 or drain > budget_s:
            return "degraded"
        return "saturated" if refusing else "healthy"
