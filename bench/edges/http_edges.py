"""Candidate HTTP stacks for kembed's REST edge, each as a front end would host it.

``python -m bench.edges.http_edges``.

One process per run: a ``grpc.aio`` server (the ``bench.tools.echo`` handler, idle on a port of its
own) and the stack's HTTP server on one asyncio loop, the HTTP server on a prebound socket with
SO_REUSEPORT, as N front ends would share the REST port. Every stack answers ``POST
/v1/embeddings`` through the same code (``answer``: orjson parse, a check of each field, and an
OpenAI-shaped reply of one precomputed 384-float embedding per text, as floats or base64), so the
stacks differ only in what they cost between the socket and that code. ``--stack grpc`` runs the
bare gRPC echo on the measured port instead, with no HTTP server: the yardstick.

Each stack is configured with the same limits (``Limits``) where it can enforce them; what each
cannot is what ``bench.edges.http_stacks`` probes. On SIGTERM the process stops accepting, lets
requests in flight finish within the drain time, and exits 0.

    python -m bench.edges.http_edges --stack httptools --port 8080 --ready-file /tmp/ready
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import importlib
import json
import math
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson

from bench.tools import echo

HOST = "127.0.0.1"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
JSON = "application/json"
# Precomputed, and not zeros: orjson writes every one of these floats on each call, as kembed will.
EMBEDDING = np.linspace(-1.0, 1.0, echo.DIMENSIONS, dtype=np.float32)
EMBEDDING_BASE64 = base64.b64encode(EMBEDDING.tobytes()).decode()
TOKENS_PER_TEXT = 16  # what the echo reports per text
MODEL_ID = "minilm"
BACKLOG = 1024

Stop = Callable[[], Awaitable[None]]  # stops the stack gracefully: stop accepting, finish what is in flight


@dataclass(frozen=True)
class Limits:
    """Every stack gets these where it can enforce them."""

    max_body_bytes: int = 1 << 20  # larger bodies: 413
    idle_s: float = 5.0  # a keep-alive connection with no request open is closed after this
    request_s: float = 10.0  # a request must arrive whole within this from its first byte (slowloris)
    drain_s: float = 10.0  # on stop, requests in flight may take this long to finish


# --- what every stack answers ---------------------------------------------------------------------


class BadRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class EmbeddingsCall:
    texts: int
    model: str
    base64: bool
    delay_s: float  # bench only: the reply waits this long (to keep a request in flight)


def parse(body: bytes) -> EmbeddingsCall:
    """The OpenAI request fields kembed reads, each checked; ``BadRequest`` names the field."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadRequest("body", f"not JSON ({error})") from None
    if not isinstance(doc, dict):
        raise BadRequest("body", "must be a JSON object")
    texts = doc.get("input")
    if isinstance(texts, str):
        count = 1
    elif isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
        count = len(texts)
    else:
        raise BadRequest("input", "must be a string or a non-empty list of strings")
    model = doc.get("model")
    if not isinstance(model, str):
        raise BadRequest("model", "must be a string")
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest("encoding_format", "must be 'float' or 'base64'")
    delay = doc.get("delay_s", 0.0)
    if not isinstance(delay, int | float) or not 0 <= delay <= 60:
        raise BadRequest("delay_s", "must be a number of seconds from 0 to 60")
    return EmbeddingsCall(count, model, encoding == "base64", float(delay))


def render(call: EmbeddingsCall) -> bytes:
    """The OpenAI-shaped reply: one embedding per text, float32 as floats or as base64 of its bytes."""
    vector: Any = EMBEDDING_BASE64 if call.base64 else EMBEDDING
    data = [{"object": "embedding", "index": i, "embedding": vector} for i in range(call.texts)]
    tokens = TOKENS_PER_TEXT * call.texts
    reply = {"object": "list", "data": data, "model": call.model,
             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
    return orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY)


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> bytes:
    """OpenAI's error shape."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}})


async def reply_to(call: EmbeddingsCall) -> bytes:
    """Where kembed will await its engine; here only the bench's optional delay."""
    if call.delay_s:
        await asyncio.sleep(call.delay_s)
    return render(call)


async def answer(body: bytes) -> tuple[int, bytes]:
    """Status and JSON body for ``POST /v1/embeddings``."""
    try:
        call = parse(body)
    except BadRequest as error:
        return 400, error_body(str(error), error.field)
    return 200, await reply_to(call)


MODELS_BODY = orjson.dumps({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "kembed"}]})
TOO_LARGE = error_body("request body too large", None)


# --- the stacks -----------------------------------------------------------------------------------


async def start_starlette(sock: socket.socket, limits: Limits) -> Stop:
    """Starlette under uvicorn (httptools parser), with Starlette's own body limit middleware."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.body_limit import RequestBodyLimitMiddleware
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def embeddings(request: Request) -> Response:
        status, body = await answer(await request.body())
        return Response(body, status, media_type=JSON)

    async def models(request: Request) -> Response:
        return Response(MODELS_BODY, media_type=JSON)

    routes = [Route(EMBEDDINGS_PATH, embeddings, methods=["POST"]), Route(MODELS_PATH, models, methods=["GET"])]
    app = Starlette(
        routes=routes, middleware=[Middleware(RequestBodyLimitMiddleware, max_body_size=limits.max_body_bytes)]
    )
    return await _uvicorn(app, sock, limits)


def _start_fastapi(docs: bool) -> Callable[[socket.socket, Limits], Awaitable[Stop]]:
    async def start(sock: socket.socket, limits: Limits) -> Stop:
        """FastAPI as it is meant to be used: a pydantic model of the body, its own body limit, under uvicorn."""
        from typing import Literal

        from fastapi import FastAPI
        from fastapi.responses import Response
        from pydantic import BaseModel, Field

        class EmbeddingsBody(BaseModel):
            input: str | list[str] = Field(min_length=1)
            model: str
            encoding_format: Literal["float", "base64"] = "float"
            delay_s: float = Field(0.0, ge=0, le=60)

        off: dict[str, Any] = {} if docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
        app = FastAPI(max_body_size=limits.max_body_bytes, **off)

        async def embeddings(body: EmbeddingsBody) -> Response:
            texts = 1 if isinstance(body.input, str) else len(body.input)
            call = EmbeddingsCall(texts, body.model, body.encoding_format == "base64", body.delay_s)
            return Response(await reply_to(call), media_type=JSON)

        # This module's annotations are strings, and FastAPI cannot resolve a function-local model by name.
        embeddings.__annotations__["body"] = EmbeddingsBody
        app.post(EMBEDDINGS_PATH, response_model=None)(embeddings)

        @app.get(MODELS_PATH, response_model=None)
        async def models() -> Response:
            return Response(MODELS_BODY, media_type=JSON)

        return await _uvicorn(app, sock, limits)

    return start


async def _uvicorn(app: Any, sock: socket.socket, limits: Limits) -> Stop:
    """uvicorn.Server(...).serve(sockets=[sock]) as a task on the running loop. It would take over
    SIGINT and SIGTERM (and raise them again on exit): the front end owns them, so not here."""
    import uvicorn

    class Embedded(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    config = uvicorn.Config(
        app, http="httptools", lifespan="off", access_log=False, log_level="warning", backlog=BACKLOG,
        timeout_keep_alive=math.ceil(limits.idle_s), timeout_graceful_shutdown=math.ceil(limits.drain_s),
    )  # fmt: skip
    server = Embedded(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn ended before it started")
        await asyncio.sleep(0.01)  # start-up only

    async def stop() -> None:
        server.should_exit = True
        await task

    return stop


async def start_aiohttp(sock: socket.socket, limits: Limits) -> Stop:
    """aiohttp.web on the prebound socket (web.SockSite); its own body limit (client_max_size)."""
    from aiohttp import web

    async def embeddings(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(body=TOO_LARGE, status=413, content_type=JSON)
        status, payload = await answer(body)
        return web.Response(body=payload, status=status, content_type=JSON)

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=MODELS_BODY, content_type=JSON)

    app = web.Application(client_max_size=limits.max_body_bytes)
    app.router.add_post(EMBEDDINGS_PATH, embeddings)
    app.router.add_get(MODELS_PATH, models)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=limits.idle_s,
                           shutdown_timeout=limits.drain_s)  # fmt: skip
    await runner.setup()
    await web.SockSite(runner, sock, backlog=BACKLOG).start()
    return runner.cleanup


async def start_httptools(sock: socket.socket, limits: Limits) -> Stop:
    """A plain asyncio.Protocol with the httptools parser (``HttpServer`` below)."""
    importlib.import_module("httptools")
    server = HttpServer(limits)
    await server.start(sock)
    return server.stop


async def start_granian(sock: socket.socket, limits: Limits) -> Stop:
    """granian's embedded server (experimental upstream): hyper on a Rust thread, the RSGI app on
    this loop. It binds its own socket (SO_REUSEPORT) and takes no prebound one: ours is closed
    first, or it would take connections nobody accepts."""
    from granian.constants import Interfaces
    from granian.http import HTTP1Settings
    from granian.server.embed import Server

    async def app(scope: Any, protocol: Any) -> None:
        route = (scope.method, scope.path)
        if route == ("GET", MODELS_PATH):
            return protocol.response_bytes(200, [("content-type", JSON)], MODELS_BODY)
        if route != ("POST", EMBEDDINGS_PATH):
            return protocol.response_bytes(404, [("content-type", JSON)], error_body("not found", None))
        declared = scope.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return protocol.response_bytes(413, [("content-type", JSON)], TOO_LARGE)
        body = bytearray()
        async for chunk in protocol:
            body += chunk
            if len(body) > limits.max_body_bytes:
                return protocol.response_bytes(413, [("content-type", JSON)], TOO_LARGE)
        status, payload = await answer(bytes(body))
        protocol.response_bytes(status, [("content-type", JSON)], payload)

    class Rsgi:
        async def __rsgi__(self, scope: Any, protocol: Any) -> None:
            await app(scope, protocol)

    port = sock.getsockname()[1]
    sock.close()
    http1 = HTTP1Settings(header_read_timeout=round(limits.request_s * 1000))
    server = Server(Rsgi(), address=HOST, port=port, interface=Interfaces.RSGI, log_enabled=False,
                    http1_settings=http1, backlog=BACKLOG, websockets=False)  # fmt: skip
    task = asyncio.create_task(server.serve())
    await _until_accepting(port, task)

    async def stop() -> None:
        server.stop()
        await task

    return stop


async def _until_accepting(port: int, task: asyncio.Task[None]) -> None:
    while True:
        if task.done():
            task.result()
            raise RuntimeError("the server ended before it started")
        try:
            _, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            await asyncio.sleep(0.01)  # start-up only
            continue
        writer.close()
        return


# --- the plain protocol ---------------------------------------------------------------------------

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


# --- the process ----------------------------------------------------------------------------------

STACKS: dict[str, Callable[[socket.socket, Limits], Awaitable[Stop]]] = {
    "starlette": start_starlette,
    "fastapi": _start_fastapi(docs=True),
    "fastapi_nodocs": _start_fastapi(docs=False),
    "aiohttp": start_aiohttp,
    "httptools": start_httptools,
    "granian": start_granian,
}
GRPC = "grpc"  # the bare gRPC echo on the measured port, no HTTP: the yardstick


def reuseport_socket(port: int) -> socket.socket:
    """A listening socket that other processes can bind too (SO_REUSEPORT), as front ends will.

    Its protocol must say TCP: asyncio sets TCP_NODELAY only on accepted sockets whose ``proto``
    is IPPROTO_TCP, and a stack that writes head and body apart (uvicorn) then waits out Nagle
    and the client's delayed ACK, about 40 ms a call."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


async def _grpc_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=echo.SERVER_OPTIONS)
    server.add_generic_rpc_handlers((echo.handler(),))
    if server.add_insecure_port(f"{HOST}:{port}") == 0:
        raise RuntimeError(f"could not bind {HOST}:{port}")
    await server.start()
    return server


async def serve(stack: str, port: int, limits: Limits, ready_file: Path) -> None:
    """Until SIGTERM: the gRPC server and the stack on one loop. ``ready_file`` gets what starting took."""
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    started = time.perf_counter()
    grpc_server = await _grpc_server(port if stack == GRPC else 0)  # idle beside an HTTP stack
    grpc_s = time.perf_counter() - started
    stop: Stop | None = None
    if stack != GRPC:
        sock = reuseport_socket(port)
        stop = await STACKS[stack](sock, limits)
    report = {"pid": os.getpid(), "grpc_start_s": grpc_s, "stack_start_s": time.perf_counter() - started - grpc_s,
              "limits": asdict(limits)}  # fmt: skip
    partial = ready_file.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    partial.rename(ready_file)  # whole, or not there
    await stopping.wait()
    if stop is not None:
        await stop()
    await grpc_server.stop(limits.drain_s)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", required=True, choices=[GRPC, *STACKS])
    parser.add_argument("--port", type=int, required=True, help="loopback port of the measured server")
    parser.add_argument("--ready-file", type=Path, required=True, help="written (JSON) once serving")
    defaults = Limits()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    limits = Limits(**{f: getattr(args, f) for f in asdict(defaults)})
    asyncio.run(serve(args.stack, args.port, limits, args.ready_file))


if __name__ == "__main__":
    main()
