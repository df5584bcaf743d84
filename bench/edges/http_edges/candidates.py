"""The candidate HTTP stacks, each started on a prebound socket with the same limits where it can
enforce them: Starlette and FastAPI under uvicorn, aiohttp, the plain protocol on httptools, and
granian."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from bench.edges.http_edges.api import (
    BACKLOG,
    EMBEDDINGS_PATH,
    HOST,
    JSON,
    MODELS_BODY,
    MODELS_PATH,
    TOO_LARGE,
    EmbeddingsCall,
    Limits,
    Stop,
    answer,
    error_body,
    reply_to,
)
from bench.edges.http_edges.plain import HttpServer


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


STACKS: dict[str, Callable[[socket.socket, Limits], Awaitable[Stop]]] = {
    "starlette": start_starlette,
    "fastapi": _start_fastapi(docs=True),
    "fastapi_nodocs": _start_fastapi(docs=False),
    "aiohttp": start_aiohttp,
    "httptools": start_httptools,
    "granian": start_granian,
}
