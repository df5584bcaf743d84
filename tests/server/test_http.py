"""The health port's HTTP, request by request, over real sockets: what a probe or a scrape sends is
answered, anything else gets a clear status, never a hang."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kembed.supervisor.http import HealthServer


def broken_health() -> dict[str, Any]:
    raise RuntimeError("a bug behind /health")


@pytest.fixture
async def port() -> AsyncIterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = HealthServer(
        listener, live=lambda: True, ready=lambda: False, health=broken_health, registry=CollectorRegistry()
    )
    await server.start()
    yield server.port
    server.close()


async def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()


REQUESTS = {
    "probe": (b"GET /livez HTTP/1.1\r\nHost: pod\r\nUser-Agent: kube-probe/1.31\r\n\r\n", b"200 OK", b"ok\n"),
    "not ready, HTTP/1.0": (b"GET /readyz?verbose HTTP/1.0\r\n\r\n", b"503 Service Unavailable", b"not ready\n"),
    "unknown path": (b"GET /nope HTTP/1.1\r\n\r\n", b"404 Not Found", b"not found\n"),
    "not GET": (b"POST /livez HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405 Method Not Allowed", b"only GET\n"),
    "no version": (b"GET /livez\r\n\r\n", b"400 Bad Request", b"bad request"),
    "head too long": (b"GET /livez HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"400 Bad Request", b"bad request"),
    "route fails": (b"GET /health HTTP/1.1\r\n\r\n", b"500 Internal Server Error", b"internal error\n"),
}


@pytest.mark.parametrize("case", REQUESTS)
async def test_each_request_gets_one_answer_and_the_connection_closes(port: int, case: str):
    request, status, body = REQUESTS[case]
    response = await exchange(port, request)
    head, _, content = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status), head
    assert b"Connection: close" in head and f"Content-Length: {len(content)}".encode() in head
    assert content.startswith(body)
