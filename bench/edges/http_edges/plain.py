"""The plain protocol: an HTTP/1.1 server of kembed's own on asyncio's protocols and httptools' parser,
with one deadline sweep for every connection, bounded heads and bodies, and early answers drained."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Awaitable, Callable
from email.utils import formatdate

from bench.edges.http_edges.api import BACKLOG, EMBEDDINGS_PATH, MODELS_BODY, MODELS_PATH, Limits, answer, error_body

Handler = Callable[[bytes], Awaitable[tuple[int, bytes]]]
REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
           413: b"Content Too Large", 431: b"Request Header Fields Too Large",
           500: b"Internal Server Error"}  # fmt: skip
SWEEP_S = 0.5  # how often deadlines are checked: one timer for every connection, none per request
MAX_HEAD_BYTES = 64 * 1024  # request line and headers
LINGER_S = 2.0  # after an early answer (413, 431, 400, 408), input is drained this long before closing


class HttpServer:
    """HTTP/1.1 with keep-alive over ``asyncio.Protocol`` and httptools. Bounded everywhere: a
    body over the limit is 413; a connection idle longer than ``idle_s`` is closed, and so is one
    whose request is not whole ``request_s`` after its first byte (slowloris); pipelined requests
    are answered in order, reading paused while one is in flight. ``stop`` stops accepting, closes
    idle connections and lets the ones in flight finish (for ``drain_s`` at most)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.routes: dict[tuple[bytes, bytes], Handler] = {
            (b"POST", EMBEDDINGS_PATH.encode()): answer,
            (b"GET", MODELS_PATH.encode()): _models,
        }
        self.paths = {path for _, path in self.routes}
        self.connections: set[HttpConnection] = set()
        self.draining = False
        self._all_closed = asyncio.Event()  # set once draining leaves no connection
        self.date = b""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, sock: socket.socket) -> None:
        self._tick()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HttpConnection(self), sock=sock, backlog=BACKLOG)
        self._sweeper = asyncio.create_task(self._sweep())

    def _tick(self) -> None:
        self.date = b"date: " + formatdate(usegmt=True).encode() + b"\r\n"

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self._tick()
            now = asyncio.get_running_loop().time()
            for connection in list(self.connections):
                connection.expire(now)

    async def stop(self) -> None:
        assert self._server is not None and self._sweeper is not None
        self.draining = True
        self._server.close()
        for connection in list(self.connections):
            connection.close_if_idle()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), self.limits.drain_s)
        for connection in list(self.connections):
            connection.abort()
        self._sweeper.cancel()
        await self._server.wait_closed()

    def forget(self, connection: HttpConnection) -> None:
        self.connections.discard(connection)
        if self.draining and not self.connections:
            self._all_closed.set()


async def _models(body: bytes) -> tuple[int, bytes]:
    return 200, MODELS_BODY


class HttpConnection(asyncio.Protocol):
    """One client connection: the httptools parser's callbacks build requests, answered one at a time."""

    def __init__(self, server: HttpServer) -> None:
        import httptools

        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.parse_error = httptools.HttpParserError
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.url = b""
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.expect_continue = False
        self.head_bytes = 0
        self.head_done = False
        self.completed = 0  # requests read whole on this connection
        self.ignoring = False  # answered early (413) or broken: the rest of the input is dropped
        self.pending: collections.deque[tuple[bytes, bytes, bytes, bool]] = collections.deque()
        self.in_flight: asyncio.Task[None] | None = None
        self.deadline = self.loop.time() + server.limits.idle_s
        self.in_request = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.forget(self)
        if self.in_flight is not None:
            self.in_flight.cancel()

    def data_received(self, data: bytes) -> None:
        if self.ignoring:
            return
        completed = self.completed
        try:
            self.parser.feed_data(data)
        except self.parse_error:
            self._fail(400, "malformed HTTP request")
            return
        # httptools holds a header until it ends: bound the head, one chunk (256 KiB at most) late.
        # A chunk that also ended an earlier request is not counted: how much of it is head is unknown.
        if self.in_request and not self.head_done and self.completed == completed:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(431, "request head too large")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.in_request = True
        self.head_done, self.head_bytes = False, 0
        self.url = b""
        self.body = []
        self.body_bytes = 0
        self.expect_continue = False
        self.deadline = self.loop.time() + self.server.limits.request_s

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" and value.isdigit() and int(value) > self.server.limits.max_body_bytes:
            self._fail(413, "request body too large")
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True

    def on_headers_complete(self) -> None:
        self.head_done = True
        if self.expect_continue and not self.ignoring and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the body is welcome: send it

    def on_body(self, body: bytes) -> None:
        if self.ignoring:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.server.limits.max_body_bytes:
            self._fail(413, "request body too large")
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.ignoring:
            return
        self.in_request = False
        self.completed += 1
        request = (self.parser.get_method(), self.url.split(b"?", 1)[0], b"".join(self.body),
                   self.parser.should_keep_alive())  # fmt: skip
        self.pending.append(request)
        if self.in_flight is None:
            self._next()
        elif self.transport is not None:
            self.transport.pause_reading()  # pipelining: one request at a time, memory bounded

    # answering
    def _next(self) -> None:
        method, path, body, keep_alive = self.pending.popleft()
        handler = self.server.routes.get((method, path))
        if handler is None:
            status = 405 if path in self.server.paths else 404
            self._respond(status, error_body(f"{method.decode()} {path.decode()}", None), keep_alive)
            self._after_response()
            return
        self.in_flight = self.loop.create_task(self._handle(handler, body, keep_alive))

    async def _handle(self, handler: Handler, body: bytes, keep_alive: bool) -> None:
        try:
            status, payload = await handler(body)
        except Exception:  # a bug in the handler: answer it, keep serving others
            status, payload = 500, error_body("internal error", None, "server_error")
        self.in_flight = None
        self._respond(status, payload, keep_alive)
        self._after_response()

    def _respond(self, status: int, body: bytes, keep_alive: bool) -> None:
        """Write the reply; without keep-alive, close once it is sent."""
        if self.transport is None or self.transport.is_closing():
            return
        keep_alive = keep_alive and not self.server.draining
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s%s\r\n" % (
            status, REASONS.get(status, b""), len(body), self.server.date,
            b"" if keep_alive else b"connection: close\r\n",
        )  # fmt: skip
        self.transport.write(head + body)
        if not keep_alive:
            self.transport.close()

    def _after_response(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.pending:
            self._next()
            return
        self.transport.resume_reading()
        if not self.in_request:
            self.deadline = self.loop.time() + self.server.limits.idle_s

    def _fail(self, status: int, message: str) -> None:
        """Answer at once, then drop the rest of this connection's input: it cannot be trusted.

        Closing at once would reset the connection while the client still sends (a body over the
        limit), and a reset discards the answer before the client reads it. So: write the answer,
        half-close, read and drop what still comes for ``LINGER_S``, then close."""
        self.ignoring = True
        self.pending.clear()
        if self.transport is None or self.transport.is_closing():
            return
        if self.in_flight is not None:  # a pipelined request went wrong behind one in flight
            self.transport.close()
            return
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n" % (status, REASONS[status])
        body = error_body(message, None)
        self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        self.transport.write_eof()
        self.deadline = self.loop.time() + LINGER_S

    # deadlines and shutdown
    def expire(self, now: float) -> None:
        """Called by the server's sweep: close a connection idle too long, or lingering long
        enough; answer 408 to one whose request is late."""
        if self.in_flight is not None or self.pending or now < self.deadline or self.transport is None:
            return
        if self.in_request and not self.ignoring:
            self._fail(408, "request not received in time")
        else:
            self.transport.close()

    def close_if_idle(self) -> None:
        if self.in_flight is None and not self.pending and not self.in_request and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
