"""The REST edge of a front end: the OpenAI embeddings API (``POST /v1/embeddings``, ``GET
/v1/models``, ``POST /tokenize``) and its description (``GET /openapi.json``, ``GET /docs``: the
routes of :data:`kembed.frontend.openapi.ROUTES`) on aiohttp's low-level server, on the front end's
event loop beside ``grpc.aio``, on a port every front end shares through SO_REUSEPORT, as they share
the gRPC port. With ``KEMBED_API_KEY_FILE`` every route but the description needs a key, checked
from the request's head before anything else (:mod:`kembed.frontend.auth`).

A REST call takes the same path as a gRPC call (the same service: validation, pushback, admission,
the same batches, the same metrics), its JSON mapped to the domain's call by
:mod:`kembed.frontend.openai_api`. aiohttp was chosen by measurement (``docs/decisions/rest-stack.md``).
With TLS configured the port serves TLS only, from the same files as the gRPC port, reloaded when
they change.

What one client can hold here is bounded (``docs/decisions/hostile-clients.md``):

- a body only as ``application/json`` (415 otherwise: a browser's cross-site "simple" POST is
  ``text/plain``), uncompressed, of at most ``KEMBED_MAX_MESSAGE_BYTES``, weighed against the front
  end's memory budget as it arrives (429 at the chunk that does not fit), a client's bodies being
  read at most a share of it, and parsed as it arrives, chunk by chunk, each chunk's work bounded,
  and refused at the first item that breaks a limit;
- time: a request's head must arrive within the idle timeout; from its head on, its body must
  arrive within ``KEMBED_DEFAULT_TIMEOUT_MS`` (else 408); its call then has the server's default
  deadline for its size (else 504: ``docs/admission.md``), and an answer larger than the
  transport's buffer must be taken within ``KEMBED_DEFAULT_TIMEOUT_MS``; a draining front end cuts
  off bodies still arriving;
- connections: at most ``KEMBED_MAX_REST_CONNECTIONS`` and half the file descriptors this process
  may open, so gRPC keeps room; past it one of the client holding the most is closed
  (:mod:`kembed.frontend.connections`);
- a client that leaves cancels its call (the engine drops its work), logged in one line.

A connection older than ``KEMBED_MAX_CONNECTION_AGE_MS`` (each its own, within 10% of it, so that
clients connected together do not come back together) gets ``Connection: close`` on its next
answer: its client's next request connects again, through the Service, to any ready pod, so a new
replica gets traffic from clients that hold pooled keep-alive connections
(``docs/decisions/connection-age.md``). A request is never cut: HTTP/1.1 carries one at a time.

Every answer, aiohttp's own refusals of malformed requests included, is in OpenAI's error shape and
counted in ``kembed_requests_total``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from kembed.config.settings import Settings
from kembed.contract import OPENAI_RETRY_COUNT_HEADER, REQUEST_ID_KEY, RETRY_ATTEMPT_KEY
from kembed.domain.errors import EmbedError
from kembed.domain.prompts import ModelPrompts
from kembed.frontend import auth, json_body, openai_api, openapi, tracing
from kembed.frontend.budget import BODY_SHARE, BODY_WEIGHT, ClientShares, MemoryBudget, Reservation
from kembed.frontend.call import EmbedCall, Limits
from kembed.frontend.connections import Connections
from kembed.frontend.gate import Gate, draining, warming_up
from kembed.frontend.json_body import Body
from kembed.frontend.openai_api import ApiError, Embeddings
from kembed.frontend.pushback import Refusal, refusal_weight, rest_client
from kembed.frontend.service import Service
from kembed.ipc.protocol import ServingInfo
from kembed.metrics import FrontendMetrics
from kembed.plumbing import api_keys, listen, request_log, tls
from kembed.policy.demand import retry_attempt

log = logging.getLogger(__name__)

JSON = "application/json"
EMBEDDINGS_PATH, MODELS_PATH, TOKENIZE_PATH = openapi.EMBEDDINGS_PATH, openapi.MODELS_PATH, openapi.TOKENIZE_PATH
METHODS = {route.path: route.method for route in openapi.ROUTES}
PUBLIC = frozenset(route.path for route in openapi.ROUTES if route.public)  # served without an API key
IDLE_S = 60.0  # a connection with no request, or whose request's head is still arriving, is closed after this
LINGER_S = 2.0  # a body refused part-read is read and dropped this long, so that its client can read the answer
STOP_S = 1.0  # stopping: the drain has waited for every call; answers still being written get this long
WRITE_BUFFER_BYTES = 65536  # aiohttp's writer waits for the client only past this much unsent (its LIMIT)
READ_CHUNK = 16384  # a body is parsed this much at a time: well under a millisecond of the event loop
MAX_BACKLOG = 128  # asyncio accepts up to a backlog's worth of connections in one turn of the event loop
# Descriptors this process keeps apart from its REST connections: the engine's socket, files,
# gRPC's poller. What is left is halved: REST connections may take one half, gRPC's the other. Of
# the REST half, asyncio accepts up to a backlog's worth of connections at once, before any can be
# closed to make room: that many are kept free.
FD_RESERVE = 64
# Bytes of an answer per value (a float written as JSON text, base64's 5.3, "-127," or "255,", and
# a binary kind's byte per eight values), and its envelope.
ANSWER_BYTES_PER_VALUE = {"float": 14, "base64": 6, "int8": 5, "uint8": 4, "binary": 1, "ubinary": 1}
ANSWER_ENVELOPE = 256
TOKEN_ANSWER_BYTES = 8  # a token id as JSON text and its comma, in a vocabulary under ten million
T = TypeVar("T")
Headers = list[tuple[str, str]]
Respond = Callable[[web.BaseRequest, Embeddings, Reservation], Awaitable[tuple[bytes, Headers]]]


class RestEdge:
    def __init__(
        self,
        settings: Settings,
        metrics: FrontendMetrics,
        gate: Gate,
        budget: MemoryBudget,
        service: Callable[[], Service],
    ) -> None:
        """``service`` gives the request path of the moment (a refusal while warming up)."""
        self._settings = settings
        self._metrics = metrics
        self._gate = gate
        self._budget = budget
        self._shares = ClientShares(budget.capacity // BODY_SHARE)  # of bodies being read, per client
        self._service = service
        self._limits = Limits.of(settings)
        self._timeout_s = settings.default_timeout_ms / 1000  # a request's, from its head
        self._served: tuple[str, ...] = ()  # the model names answered to, once the engine is warm
        self._dimensions = 0  # the model's, once warm
        self._prompts = ModelPrompts({})  # the model's, once warm
        self._created = int(time.time())
        self._keys = api_keys.read(settings)
        described, page = openapi.serialized(settings, self._keys is not None)
        self._pages = {openapi.OPENAPI_PATH: (described, JSON), openapi.DOCS_PATH: (page, openapi.HTML)}
        self._draining = False
        self._reading: set[asyncio.Timeout] = set()  # the deadlines of bodies still arriving
        self._tls = tls.ServerContext(files) if (files := tls.TlsFiles.of(settings)) else None
        allowed, self._backlog = fd_budget()
        self.max_connections = min(settings.max_rest_connections, allowed)
        self._server = Connections(
            self._handle,
            limit=self.max_connections,
            error=self._malformed,
            max_age_s=settings.max_connection_age_ms / 1000,
            keepalive_timeout=IDLE_S,
            lingering_time=LINGER_S,
            auto_decompress=False,  # a compressed body is refused: its size would say nothing
            access_log=None,
        )
        self._runner = web.ServerRunner(self._server, handle_signals=False, shutdown_timeout=STOP_S)

    async def start(self) -> None:
        """Listen on the shared REST port (plaintext, or TLS only when TLS is configured)."""
        await self._runner.setup()
        sock = listen.bind(self._settings.grpc_host, self._settings.rest_port, "REST", "rest_port", reuse_port=True)
        context = self._tls.context if self._tls else None
        await web.SockSite(self._runner, sock, ssl_context=context, backlog=self._backlog).start()

    def serve_model(self, info: ServingInfo) -> None:
        """The engine is warm: answer to its model id, and to the configured alias first."""
        alias = self._settings.served_model_name
        self._served = tuple(dict.fromkeys(name for name in (alias, info.model_id) if name))
        self._dimensions = info.dimensions
        self._prompts = ModelPrompts(info.prompts, info.default_prompt_name)

    def refresh_tls(self) -> None:
        """Pick up rotated certificate files (every front-end tick)."""
        if self._tls is not None:
            self._tls.refresh()

    def drain(self) -> None:
        """Take no more requests, and cut off the bodies still arriving: none is accepted work."""
        self._draining = True
        now = asyncio.get_running_loop().time()
        for deadline in self._reading:
            deadline.reschedule(now)

    async def stop(self) -> None:
        """Stop listening and close every connection (the front end's drain has waited for its calls)."""
        await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        # A connection's task serves its requests in turn: each one's id is set, then taken back.
        named = request_log.request_id.set(request_log.adopt(request.headers.get(REQUEST_ID_KEY)))
        try:
            response = await self._route(request)
        finally:
            request_log.request_id.reset(named)
        self._close_if_aged(request, response)
        return response

    def _close_if_aged(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """Past its age, the connection closes after this answer, which says so (a written answer's
        head is sent already: :meth:`_write` asks before it)."""
        if not response.prepared and self._server.aged(request.protocol):
            response.force_close()

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        path, method = request.path, request.method
        self._server.reading(request.protocol)
        try:
            if (refused := self._unauthorized(request)) is not None:
                return self._refuse(refused, close=not request.content.is_eof())
            if path == EMBEDDINGS_PATH and method == "POST":
                return await self._call(request, self._embed)
            if path == TOKENIZE_PATH and method == "POST":
                return await self._call(request, self._tokenize)
            if path == MODELS_PATH and method == "GET":
                self._server.working(request.protocol)
                return self._reply(200, openai_api.models(self._served, self._created, self._prompts))
            if method == "GET" and (described := self._pages.get(path)) is not None:
                return self._reply(200, *described)
            if allowed := METHODS.get(path):
                error = ApiError.invalid(405, f"{method} {path}: only {allowed}", "method_not_allowed")
                error.headers["Allow"] = allowed
                return self._refuse(error)
            return self._refuse(ApiError.invalid(404, f"{path}: no such route", "not_found"))
        except asyncio.CancelledError:
            if request.transport is None or request.transport.is_closing():
                when = "before its answer" if request.content.is_eof() else "while sending its request"
                log.info("rest: %s left %s; its call is dropped", _peer(request), when)
                self._metrics.calls_gone.labels(api="rest").inc()
            raise
        except Exception:  # a bug: logged with its traceback, and the client still gets an answer in its API's shape
            log.exception("rest: %s %s failed", method, path)
            return self._refuse(ApiError.internal())
        finally:
            self._server.done(request.protocol)

    def _unauthorized(self, request: web.BaseRequest) -> ApiError | None:
        """The 401 of a call without a key where one is required: from its head, before anything is read."""
        if self._keys is None or request.path in PUBLIC:
            return None
        return auth.refusal(self._keys, request.headers.get("Authorization"))

    async def _call(self, request: web.BaseRequest, respond: Respond) -> web.StreamResponse:
        """A call's body read and parsed, then answered by ``respond``, its answer's bytes weighed."""
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        parsed: Embeddings | None = None
        reservation: Reservation | None = None
        try:
            self._check_head(request)
            # The body's bytes are held as they arrive until it is parsed, then its answer's until
            # written: a head alone holds nothing (heads declaring 2 MiB once held a budget full).
            reservation = self._budget.reserve(0)
            if request.headers.get("Expect", "").lower() == "100-continue":
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # its body is welcome
                request.writer.output_size = 0
            parsed = await self._read(request, reservation, deadline)
            reservation.release()
            self._server.working(request.protocol)
            return await self._write(request, 200, *await respond(request, parsed, reservation))
        except ApiError as api_error:
            error = api_error
        except EmbedError as embed_error:
            error = openai_api.failed(embed_error, parsed is not None and parsed.nested)
        except TimeoutError:
            if self._draining:
                error = openai_api.failed(draining())
            else:
                message = f"the body did not arrive within {self._timeout_s:g} s of its head"
                error = ApiError.invalid(408, message, "request_timeout")
        except (ConnectionError, web.RequestPayloadError):  # gone mid-body: nobody to answer
            log.info("rest: %s left while sending its request", _peer(request))
            self._metrics.calls_gone.labels(api="rest").inc()
            return web.Response(status=400)
        finally:
            if reservation is not None:
                reservation.release()
        return self._refuse(error, close=not request.content.is_eof())

    def _check_head(self, request: web.BaseRequest) -> None:
        """What the head alone decides, before a byte of the body is read."""
        if request.content_type != JSON:
            message = f"Content-Type: {request.content_type!r}, but the body must be {JSON}"
            raise ApiError.invalid(415, message, "unsupported_media_type")
        if request.headers.get("Content-Encoding", "identity").lower() != "identity":
            message = "Content-Encoding: the body must be sent uncompressed"
            raise ApiError.invalid(415, message, "unsupported_media_type")
        if self._draining:
            raise draining()
        self._gate.check_open()  # the whole pod is draining
        if not self._served:
            raise warming_up()
        if (request.content_length or 0) > self._settings.max_message_bytes:
            raise self._too_large()

    async def _read(self, request: web.BaseRequest, reservation: Reservation, deadline: float) -> Embeddings:
        """The body, parsed as it arrives, by ``deadline``. One already here that fits a chunk is
        read at once; any other chunk by chunk, the event loop free between chunks: the same parser
        and the same answer either way. The call states no deadline (OpenAI's API has none): it gets
        the server's default for its size. Its peer is the client's address, so a new connection per
        call does not evade its pushback."""
        client = rest_client(request.remote or "")
        content, peer = request.content, f"rest:{client}"
        if content.is_eof() and content.total_bytes <= READ_CHUNK:
            reservation.grow(BODY_WEIGHT * content.total_bytes)
            return json_body.parse(content.read_nowait(), self._served, self._limits, peer)
        reader, limit = Body(self._limits), self._settings.max_message_bytes
        with self._shares.holding(client) as share:
            async with asyncio.timeout_at(deadline) as timeout:
                self._reading.add(timeout)
                try:
                    while chunk := await content.read(READ_CHUNK):
                        if content.total_bytes > limit:  # a fault within the limit comes first
                            reader.feed(chunk[: len(chunk) - (content.total_bytes - limit)])
                            raise self._too_large()
                        share.grow(BODY_WEIGHT * len(chunk))  # the client's share first: its own refusal
                        reservation.grow(BODY_WEIGHT * len(chunk))
                        reader.feed(chunk)
                        await asyncio.sleep(0)  # others' turn, even when the rest of the body is here already
                finally:
                    self._reading.discard(timeout)
        return reader.finish(self._served, peer)

    async def _embed(
        self, request: web.BaseRequest, parsed: Embeddings, reservation: Reservation
    ) -> tuple[bytes, Headers]:
        """The call's answer and its timing headers (a refusal's paced: :meth:`_paced`)."""
        dimensions = min(parsed.call.dimensions or self._dimensions, self._dimensions)
        reservation.grow(parsed.call.count * dimensions * ANSWER_BYTES_PER_VALUE[parsed.encoding] + ANSWER_ENVELOPE)
        embedding = self._service().embed(_with_attempt(parsed.call, request))
        result = await self._paced(request, parsed, reservation, embedding)
        tracing.record("POST " + EMBEDDINGS_PATH, lambda: request.headers, result)
        return openai_api.answer(parsed, result), result.timing_headers()

    async def _tokenize(
        self, request: web.BaseRequest, parsed: Embeddings, reservation: Reservation
    ) -> tuple[bytes, Headers]:
        chunks = await self._paced(request, parsed, reservation, self._service().tokenize(parsed.call))
        reservation.grow(int(chunks.seqs.ids.size) * TOKEN_ANSWER_BYTES + ANSWER_ENVELOPE)  # before it is written
        return openai_api.tokens(parsed, chunks), []

    async def _paced(
        self, request: web.BaseRequest, parsed: Embeddings, reservation: Reservation, work: Awaitable[T | Refusal]
    ) -> T:
        """``work``'s result. A refusal's answer is paced, weighing the body's bytes, holding nothing
        another client needs: its answer's bytes are let go, and its connection counts as idle (the
        first closed for room)."""
        outcome = await work
        if isinstance(outcome, Refusal):
            reservation.release()
            self._server.done(request.protocol)
            await outcome.answerable(refusal_weight(request.content.total_bytes))
            raise outcome.error
        return outcome

    async def _write(self, request: web.BaseRequest, status: int, body: bytes, headers: Headers) -> web.StreamResponse:
        """The answer, written here while its bytes are still weighed, within the request's timeout.
        One that fits the transport's buffer is left to aiohttp: writing it does not wait (a client that
        never reads it leaves its connection idle, the first closed when room is needed)."""
        response = self._reply(status, body, headers=dict(headers))
        if len(body) <= WRITE_BUFFER_BYTES:
            return response
        self._close_if_aged(request, response)
        try:
            async with asyncio.timeout(self._timeout_s):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            log.info("rest: %s did not read its answer within %g s: closed", _peer(request), self._timeout_s)
            request.protocol.force_close()
        return response

    def _too_large(self) -> ApiError:
        limit = self._settings.max_message_bytes
        return ApiError.invalid(413, f"the body is over {limit} bytes", "request_too_large")

    def _malformed(self, status: int, reason: str) -> web.Response:
        """aiohttp refused a request it could not parse (its head): one log line, OpenAI's shape."""
        log.info("rest: a malformed request refused: %s", reason)
        return self._refuse(ApiError.invalid(status, f"malformed request: {reason}"), close=True)

    def _refuse(self, error: ApiError, close: bool = False) -> web.Response:
        response = self._reply(error.status, error.body(), headers=error.headers)
        if close:  # the rest of its body is not read: the connection cannot carry another request
            response.force_close()
        return response

    def _reply(
        self, status: int, body: bytes, content_type: str = JSON, headers: dict[str, str] | None = None
    ) -> web.Response:
        self._metrics.answered("rest", str(status))
        response = web.Response(status=status, body=body, headers=headers)
        response.headers["Content-Type"] = content_type
        if named := request_log.request_id.get():  # none on a head aiohttp could not parse
            response.headers[REQUEST_ID_KEY] = named
        return response


def fd_budget() -> tuple[int, int]:
    """How many REST connections this process may hold, and accept at once (its listen backlog):
    together half the file descriptors it may open past its reserve, so that gRPC keeps the other."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    half = max(2, (soft - FD_RESERVE) // 2)
    backlog = max(1, min(MAX_BACKLOG, half // 4))
    return max(1, half - backlog), backlog


def raise_fd_limit() -> None:
    """Up to the hard limit: the soft one is often lower than a server needs, and nobody's to lose."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _with_attempt(call: EmbedCall, request: web.BaseRequest) -> EmbedCall:
    """The call with its earlier attempts, as its retry marker says: the openai SDKs', or kembed's."""
    headers = request.headers
    attempt = retry_attempt(headers.get(OPENAI_RETRY_COUNT_HEADER) or headers.get(RETRY_ATTEMPT_KEY))
    return dataclasses.replace(call, attempt=attempt) if attempt else call


def _peer(request: web.BaseRequest) -> Any:
    transport = request.transport
    return transport.get_extra_info("peername") if transport is not None else request.remote
