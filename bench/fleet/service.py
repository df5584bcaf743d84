"""A ClusterIP Service and the clients that hold connections through it, for ``bench.fleet``.

kube-proxy balances connections, not calls: it picks a ready endpoint when a connection opens (at
random, as its iptables mode does), and every byte of that connection goes there for its life,
even after the pod leaves the endpoints. :class:`ClusterIP` is that, as a TCP proxy on loopback,
one listening port per Service port (gRPC, REST). The clients are several client processes, each
holding its own connections: a gRPC channel with kembed's client defaults (one connection, pick
first), or a pool of keep-alive HTTP/1.1 connections as the ``openai`` SDK's httpx holds them. They
reach a new pod only when a connection of theirs is closed (the server's connection age) and opened
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import aiohttp
import grpc

from bench.tools.loadgen import EMBED_METHOD
from kembed.client.connection import Connection
from kembed.contract import RETRY_ATTEMPT_KEY
from kembed.v1 import embedder_pb2

T = TypeVar("T")


class Endpoint(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Endpoint)
READ_BYTES = 65536
REST_KEEPALIVE_S = 5.0  # httpx's keepalive_expiry, the openai SDK's pool
REST_POOL = 1000  # the openai SDK's max_connections
REFUSED_STATUSES = (429, 503)
RETRY_COUNT_HEADER = "x-stainless-retry-count"  # the openai SDK's, on every attempt


def pushback_s(headers: Mapping[str, str]) -> float:
    """A refusal's pushback as the openai SDK reads it: ``retry-after-ms`` first, then Retry-After."""
    if (ms := headers.get("retry-after-ms")) is not None:
        return float(ms) / 1000
    return float(headers["Retry-After"])


def pick(endpoints: Sequence[T], rng: random.Random) -> T | None:
    """The endpoint a new connection goes to: one of the ready ones at random, none without any."""
    return rng.choice(endpoints) if endpoints else None


class ClusterIP(Generic[E]):
    """One Service port: each accepted connection is piped to ``address_of`` (``host:port``) a ready
    pod, picked then; ``first_connection`` records when each pod got its first connection."""

    def __init__(
        self, endpoints: Callable[[], Sequence[E]], address_of: Callable[[E], str], rng: random.Random
    ) -> None:
        self._endpoints, self._address_of, self._rng = endpoints, address_of, rng
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self.first_connection: dict[str, float] = {}
        self.connections = 0

    async def start(self, clock: Callable[[], float]) -> str:
        self._clock = clock
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        replica = pick(self._endpoints(), self._rng)
        if replica is None:  # a Service without endpoints refuses the connection
            writer.close()
            return
        self.connections += 1
        self.first_connection.setdefault(replica.name, self._clock())
        try:
            host, port = self._address_of(replica).rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:  # the pod is gone: the client sees its connection reset
            writer.close()
            return
        both = [_pipe(reader, up_writer), _pipe(up_reader, writer)]
        tasks = [asyncio.create_task(p) for p in both]
        self._pipes.update(tasks)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:  # one side ended: the other is closed with it
            task.cancel()
            self._pipes.discard(task)
        for end in (writer, up_writer):
            end.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(READ_BYTES):
            writer.write(data)
            await writer.drain()


class GrpcProcess:
    """One client process on gRPC: a channel with kembed's client options, its own connection (not
    shared with the other processes' channels, as in separate processes)."""

    def __init__(self, target: str) -> None:
        options = [*Connection(target).options(), ("grpc.use_local_subchannel_pool", 1)]
        self._channel = grpc.aio.insecure_channel(target, options=options)
        self._embed = self._channel.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=None)

    async def call(
        self, request: bytes, timeout_s: float, attempt: int = 0
    ) -> tuple[str, float] | grpc.aio.AioRpcError:
        """``ok`` (no pushback) or the error; ``attempt``: the attempts sent before this one, said
        as kembed's client says it."""
        metadata = ((RETRY_ATTEMPT_KEY, str(attempt)),) if attempt else None
        try:
            await self._embed(request, timeout=timeout_s, metadata=metadata)
            return "ok", 0.0
        except grpc.aio.AioRpcError as err:
            return err

    async def close(self) -> None:
        await self._channel.close(None)


class RestProcess:
    """One client process on the OpenAI API: a pool of keep-alive connections, as the SDK's."""

    def __init__(self, base_url: str) -> None:
        connector = aiohttp.TCPConnector(limit=REST_POOL, keepalive_timeout=REST_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(base_url, connector=connector)

    async def call(self, request: bytes, timeout_s: float, attempt: int = 0) -> tuple[str, float]:
        """``ok``, ``refused`` (429 or 503 with a Retry-After) or ``lost: WHY``, with the pushback in
        seconds; ``attempt``: the attempts sent before this one, said as the SDK says it."""
        parsed = embedder_pb2.EmbedRequest.FromString(request)
        body = json.dumps({"input": list(parsed.texts), "truncate": parsed.truncate}).encode()  # the model served
        headers = {"Content-Type": "application/json", RETRY_COUNT_HEADER: str(attempt)}
        try:
            async with self._session.post(
                "/v1/embeddings", data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as answer:
                await answer.read()
                if answer.status == 200:
                    return "ok", 0.0
                if answer.status in REFUSED_STATUSES and "Retry-After" in answer.headers:
                    return "refused", pushback_s(answer.headers)
                return f"lost: REST {answer.status}", 0.0
        except (aiohttp.ClientError, TimeoutError) as error:
            return f"lost: REST {type(error).__name__}", 0.0

    async def close(self) -> None:
        await self._session.close()
