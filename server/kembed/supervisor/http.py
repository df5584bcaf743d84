"""Health and metrics over HTTP on their own port: /livez, /readyz, /health (JSON) and /metrics.

Served on the supervisor's event loop, which does nothing but wait on its children, so probes
answer whatever the other processes are doing. What probes and Prometheus send is all it takes:
``GET`` over HTTP/1.x, one request per connection (``Connection: close``). A connection has
``timeout_s`` for its whole exchange and a request head of at most MAX_HEAD_BYTES, and past
``max_connections`` open at once the oldest is closed: idle or slow clients can neither pile up
nor keep the probes out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from http import HTTPStatus
from types import TracebackType
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kembed.contract import HEALTH_PATH, LIVEZ_PATH, METRICS_PATH, READYZ_PATH

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 10.0  # Prometheus's default scrape timeout; kubelet gives probes 1 s
MAX_HEAD_BYTES = 8192
TEXT = "text/plain"
BAD_REQUEST = f"bad request: expected GET <path> HTTP/1.x, its head within {MAX_HEAD_BYTES} bytes\n".encode()

Answer = tuple[int, str, bytes]


class HealthServer:
    def __init__(
        self,
        listener: socket.socket,
        *,
        live: Callable[[], bool],
        ready: Callable[[], bool],
        health: Callable[[], dict[str, Any]],
        registry: CollectorRegistry,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """Serve on ``listener``, a bound socket (bound by the caller, so a port in use fails early)."""
        self._routes: dict[str, Callable[[], Answer]] = {
            LIVEZ_PATH: lambda: _probe(live()),
            READYZ_PATH: lambda: _probe(ready()),
            HEALTH_PATH: lambda: (200, "application/json", json.dumps(health()).encode()),
            METRICS_PATH: lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
        }
        self._max_connections = max_connections
        self._timeout = timeout_s
        self._socket = listener
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], None] = {}  # in the order they opened

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._socket, limit=MAX_HEAD_BYTES)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._socket.close()
        for connection in list(self._connections):
            connection.cancel()

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = asyncio.current_task()
        assert connection is not None  # start_server runs each connection in a task of its own
        if len(self._connections) >= self._max_connections:
            next(iter(self._connections)).cancel()  # the oldest: the nearest to its timeout anyway
        self._connections[connection] = None
        try:
            async with asyncio.timeout(self._timeout):
                writer.write(_response(*self._answer(await _request_line(reader))))
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went quiet or away: nothing to answer
        except asyncio.CancelledError:
            pass  # closed to make room, or the server stops: Python 3.11 would log it as an error
        finally:
            del self._connections[connection]
            writer.close()

    def _answer(self, request_line: str | None) -> Answer:
        parts = (request_line or "").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, TEXT, BAD_REQUEST
        method, target, _ = parts
        if method != "GET":
            return 405, TEXT, b"only GET\n"
        route = self._routes.get(target.split("?", 1)[0])
        if route is None:
            return 404, TEXT, b"not found\n"
        try:
            return route()
        except Exception:
            log.exception("%s failed", target)
            return 500, TEXT, b"internal error\n"


async def _request_line(reader: asyncio.StreamReader) -> str | None:
    """The request line, once the whole head has arrived; None if the head is too long."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        return None
    return head.split(b"\r\n", 1)[0].decode("latin-1")


def _response(status: int, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _probe(ok: bool) -> Answer:
    return (200, TEXT, b"ok\n") if ok else (503, TEXT, b"not ready\n")
