"""The REST edge of a front end: the OpenAI embeddings API (``POST /v1/embeddings``, ``GET
/v1/models``) on aiohttp, on the front end's event loop beside ``grpc.aio``, on a port every front
end shares through SO_REUSEPORT, as they share the gRPC port.

A REST call takes the same path as a gRPC call (the same service: validation, pushback, admission,
the same batches, the same metrics), its JSON mapped to the domain's call by
:mod:`kembed.frontend.openai_api`. aiohttp was chosen
by measurement (``bench/README.md``, "REST edge: the HTTP stack") and for being the field's
library: a third of the gRPC echo's CPU per call, and it bounds bodies (413), headers, idle and
slow connections itself. With TLS configured the port serves TLS only, from the same files as the
gRPC port, reloaded when they change.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from aiohttp import web

from kembed import tls
from kembed.config import Settings
from kembed.errors import EmbedError
from kembed.frontend import openai_api
from kembed.frontend.call import Limits
from kembed.frontend.openai_api import ApiError, Embeddings
from kembed.frontend.pushback import rest_client
from kembed.frontend.service import Service, warming_up
from kembed.metrics import FrontendMetrics

log = logging.getLogger(__name__)

JSON = "application/json"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
IDLE_S = 60.0  # a keep-alive connection with no request open is closed after this
BACKLOG = 1024


class RestEdge:
    def __init__(self, settings: Settings, metrics: FrontendMetrics, service: Callable[[], Service]) -> None:
        """``service`` gives the request path of the moment (a refusal while warming up)."""
        self._settings = settings
        self._metrics = metrics
        self._service = service
        self._limits = Limits.of(settings)
        self._served: tuple[str, ...] = ()  # the model names answered to, once the engine is warm
        self._created = int(time.time())
        self._tls = tls.ServerContext(files) if (files := tls.TlsFiles.of(settings)) else None
        app = web.Application(client_max_size=settings.max_message_bytes)
        app.router.add_post(EMBEDDINGS_PATH, self._embeddings)
        app.router.add_get(MODELS_PATH, self._models)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            keepalive_timeout=IDLE_S,
            shutdown_timeout=settings.drain_timeout_s,
        )

    async def start(self) -> None:
        """Listen on the shared REST port (plaintext, or TLS only when TLS is configured)."""
        await self._runner.setup()
        sock = _shared_socket(self._settings.grpc_host, self._settings.rest_port)
        context = self._tls.context if self._tls else None
        await web.SockSite(self._runner, sock, ssl_context=context, backlog=BACKLOG).start()

    def serve_model(self, model_id: str) -> None:
        """The engine is warm: answer to its model id, and to the configured alias first."""
        alias = self._settings.served_model_name
        self._served = tuple(dict.fromkeys(name for name in (alias, model_id) if name))

    def refresh_tls(self) -> None:
        """Pick up rotated certificate files (every front-end tick)."""
        if self._tls is not None:
            self._tls.refresh()

    async def stop(self) -> None:
        """Stop listening and let calls in flight finish (the front end's drain has waited for them)."""
        await self._runner.cleanup()

    async def _embeddings(self, request: web.Request) -> web.Response:
        parsed: Embeddings | None = None
        try:
            body = await request.read()
            if not self._served:
                raise warming_up()
            # Pushback is enforced per client address: a new connection per call does not evade it.
            parsed = openai_api.parse(body, self._served, self._limits, f"rest:{rest_client(request.remote or '')}")
            result = await self._service().embed(parsed.call)
            return self._reply(200, openai_api.answer(parsed, result))
        except web.HTTPRequestEntityTooLarge:
            limit = self._settings.max_message_bytes
            error = ApiError(413, f"the body is over {limit} bytes", "invalid_request_error", None, "request_too_large")
        except ApiError as api_error:
            error = api_error
        except EmbedError as embed_error:
            error = openai_api.failed(embed_error, parsed is not None and parsed.nested)
        return self._reply(error.status, error.body(), error.headers)

    async def _models(self, request: web.Request) -> web.Response:
        return self._reply(200, openai_api.models(self._served, self._created))

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
        self._metrics.requests.labels(api="rest", code=str(status)).inc()
        return web.Response(status=status, body=body, content_type=JSON, headers=headers)


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that every front end binds (SO_REUSEPORT): the kernel
    spreads connections over them, as for gRPC."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock
