"""The attackers of ``bench.serving.attacks`` (issue 57's reproductions), each run in a process of
its own until its ``stop`` is set: calls that never send their message, REST heads without a body,
calls that would inflate or deflate the demand gauge, large bodies, idle connections from many
addresses; and ``ingest``, a well-behaved client of the same texts, for comparison."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

import grpc

from bench.tools.server import HOST
from kembed.client import EmbedClient, EmbedError
from kembed.contract import GRPC_SERVICE, RETRY_ATTEMPT_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
SENTENCE = "Admission control rejects early instead of queueing into timeouts and memory exhaustion."
WORDS = ["kubernetes", "scales", "embedding", "servers", "on", "their", "own", "metrics", "and", "refuses"]


def big_body() -> bytes:
    """1,024 texts of about 900 characters: 925 KB."""
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(130))[:900] for i in range(1024)]
    return json.dumps({"input": texts}).encode()


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def silent(target: str, calls: int, stop: Event) -> None:
    """gRPC Embed calls that send their head and never their message, reopened when cut."""

    async def run() -> None:
        channels = [grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(7)]
        embeds = [
            c.stream_unary(
                f"/{GRPC_SERVICE}/Embed",
                request_serializer=pb.EmbedRequest.SerializeToString,
                response_deserializer=pb.EmbedResponse.FromString,
            )
            for c in channels
        ]

        async def nothing() -> Any:
            await asyncio.sleep(3600)
            yield pb.EmbedRequest()

        async def hold(embed: Any) -> None:
            while not stop.is_set():
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await embed(nothing(), timeout=300)

        tasks = [asyncio.create_task(hold(embeds[i % len(embeds)])) for i in range(calls)]
        await asyncio.to_thread(stop.wait)
        for task in tasks:
            task.cancel()
        for channel in channels:
            await channel.close(None)

    asyncio.run(run())


def _hold_sockets(opened: Callable[[], socket.socket | None], count: int, stop: Event) -> None:
    """``count`` sockets from ``opened``, each opened again when the server closes it."""
    held: list[socket.socket] = []
    while not stop.is_set():
        while len(held) < count and (sock := opened()) is not None:
            held.append(sock)
        kept = []
        for sock in held:
            try:
                if sock.recv(65536, socket.MSG_DONTWAIT) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            kept.append(sock)
        held = kept
        stop.wait(0.2)
    for sock in held:
        sock.close()


def heads(port: int, length: int, count: int, stop: Event) -> None:
    def opened() -> socket.socket | None:
        try:
            sock = socket.create_connection((HOST, port), timeout=5)
            sock.sendall(post_head("/v1/embeddings", length))
            return sock
        except OSError:
            return None

    _hold_sockets(opened, count, stop)


def idle_addresses(port: int, stop: Event) -> None:
    addresses = iter(range(10**9))

    def opened() -> socket.socket | None:
        source = (f"127.0.0.{10 + next(addresses) % 16}", 0)
        try:
            return socket.create_connection((HOST, port), timeout=5, source_address=source)
        except OSError:
            return None

    _hold_sockets(opened, 16, stop)


def inflate(target: str, stop: Event) -> None:
    request = pb.EmbedRequest(texts=["a"] * 1024, prompt="a " * 250)

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)

            async def one() -> None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Embed(request, timeout=1.0)

            pending = set()
            while not stop.is_set():
                pending.add(asyncio.create_task(one()))
                pending = {task for task in pending if not task.done()}
                await asyncio.sleep(0.05)

    asyncio.run(run())


def deflate(target: str, stop: Event) -> None:
    request = pb.EmbedRequest(texts=[SENTENCE] * 8)

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)

            async def caller() -> None:
                while not stop.is_set():
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await stub.Embed(request, timeout=30, metadata=((RETRY_ATTEMPT_KEY, "1"),))

            await asyncio.gather(*(caller() for _ in range(16)))

    asyncio.run(run())


def ingest(target: str, stop: Event) -> None:
    """Not an attack: the texts of ``bodies`` sent as a well-behaved client does (kembed's client:
    one call at a time, its pushback honoured, its retries marked), for comparison."""
    texts = json.loads(big_body())["input"]
    with EmbedClient(target) as client:
        while not stop.is_set():
            with contextlib.suppress(EmbedError):
                client.embed(texts)


def bodies(port: int, path: str, stop: Event) -> None:
    body = big_body()

    async def connection() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(HOST, port)
                try:
                    while not stop.is_set():
                        writer.write(post_head(path, len(body)) + body)
                        head = await reader.readuntil(b"\r\n\r\n")
                        length = int(re.search(rb"Content-Length: (\d+)", head, re.I)[1])  # type: ignore[index]
                        await reader.readexactly(length)
                        if b"Connection: close" in head:
                            break
                finally:
                    writer.close()
            except (OSError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.05)

    async def run() -> None:
        await asyncio.gather(*(connection() for _ in range(4)))

    asyncio.run(run())
