"""The candidate REST edge's shared request code and the plain httptools protocol (bench.edges.http_edges),
over real loopback connections."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest

from bench.edges.http_edges import api, plain, process
from bench.edges.http_edges.api import BadRequest, Limits
from bench.edges.http_edges.plain import HttpServer

PATIENCE_S = 60.0  # for conditions that must come: generous, never a bound on how fast
BODY = b'{"input": "one short text", "model": "m"}'


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{", "body"),
        (b"[1]", "body"),
        (b'{"model": "m"}', "input"),
        (b'{"input": [], "model": "m"}', "input"),
        (b'{"input": ["a", 1], "model": "m"}', "input"),
        (b'{"input": "a"}', "model"),
        (b'{"input": "a", "model": "m", "encoding_format": "int8"}', "encoding_format"),
        (b'{"input": "a", "model": "m", "delay_s": -1}', "delay_s"),
    ],
)
def test_a_bad_request_names_its_field(body: bytes, field: str) -> None:
    with pytest.raises(BadRequest) as caught:
        api.parse(body)
    assert caught.value.field == field


def test_replies_carry_the_embedding_as_floats_or_base64() -> None:
    floats = json.loads(api.render(api.parse(b'{"input": ["a", "b"], "model": "m"}')))
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert np.array_equal(np.array(floats["data"][1]["embedding"], np.float32), api.EMBEDDING)
    assert floats["usage"] == {"prompt_tokens": 32, "total_tokens": 32}
    call = api.parse(b'{"input": "a", "model": "m", "encoding_format": "base64"}')
    packed = json.loads(api.render(call))["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), np.float32), api.EMBEDDING)


async def serving(limits: Limits) -> tuple[HttpServer, int]:
    server = HttpServer(limits)
    sock = process.reuseport_socket(0)
    await server.start(sock)
    return server, sock.getsockname()[1]


@pytest.fixture
async def edge() -> AsyncIterator[tuple[HttpServer, int]]:
    server, port = await serving(Limits(max_body_bytes=1024))
    yield server, port
    await server.stop()


def post(body: bytes, path: str = api.EMBEDDINGS_PATH, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in (f"POST {path} HTTP/1.1", "host: x", f"content-length: {len(body)}", *headers))
    return head.encode() + b"\r\n" + body


async def reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), PATIENCE_S)
    status_line, *lines = head.decode().split("\r\n")[:-2]
    headers = dict(line.lower().split(": ", 1) for line in lines)
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


async def closed(reader: asyncio.StreamReader) -> bool:
    """True once the server has closed the connection (whatever it sent before)."""
    async with asyncio.timeout(PATIENCE_S):
        while await reader.read(65536):
            pass
    return True


async def test_keep_alive_and_pipelined_requests_answered_in_order(edge: tuple[HttpServer, int]) -> None:
    reader, writer = await asyncio.open_connection(api.HOST, edge[1])
    bodies = [
        json.dumps({"input": "t", "model": m, "delay_s": d}).encode() for m, d in (("a", 0.05), ("b", 0), ("c", 0))
    ]
    writer.write(b"".join(post(b) for b in bodies))  # three requests in one write
    models = []
    for _ in bodies:
        status, headers, body = await reply(reader)
        assert status == 200 and "connection" not in headers
        models.append(json.loads(body)["model"])
    assert models == ["a", "b", "c"]
    writer.write(post(BODY))
    assert (await reply(reader))[0] == 200  # the same connection, still open
    writer.close()


async def test_limits_and_errors_get_their_status(edge: tuple[HttpServer, int]) -> None:
    cases = [
        (post(b" " * 2048), 413, True),  # declared too large: answered before the body
        (post(BODY, "/v1/nothing"), 404, False),
        (b"GET /v1/embeddings HTTP/1.1\r\nhost: x\r\n\r\n", 405, False),
        (post(b'{"input": 3, "model": "m"}'), 400, False),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, True),
    ]
    for request, status, closes in cases:
        reader, writer = await asyncio.open_connection(api.HOST, edge[1])
        writer.write(request)
        got, headers, body = await reply(reader)
        assert (got, headers.get("connection") == "close") == (status, closes), request
        assert "error" in json.loads(body)
        writer.close()


async def test_an_oversized_body_sent_whole_still_reads_its_413(edge: tuple[HttpServer, int]) -> None:
    """Like most clients, this one sends the whole body before it reads: the answer must survive
    (a server that closes at once resets the connection, and the reset discards the answer)."""
    reader, writer = await asyncio.open_connection(api.HOST, edge[1])
    chunk, chunks = b" " * 65536, 64  # 4 MiB, far over the socket buffers
    writer.write(post(b"")[:-2].replace(b"content-length: 0", b"content-length: %d" % (len(chunk) * chunks)) + b"\r\n")
    for _ in range(chunks):
        writer.write(chunk)
        await writer.drain()
    status, headers, _ = await reply(reader)
    assert (status, headers["connection"]) == (413, "close")
    assert await closed(reader)


async def test_a_request_head_over_the_bound_is_431(edge: tuple[HttpServer, int]) -> None:
    reader, writer = await asyncio.open_connection(api.HOST, edge[1])
    writer.write(post(BODY, api.EMBEDDINGS_PATH, "x-padding: " + "a" * (2 * plain.MAX_HEAD_BYTES)))
    assert (await reply(reader))[0] == 431
    assert await closed(reader)


async def test_chunked_bodies_are_read_and_bounded(edge: tuple[HttpServer, int]) -> None:
    def chunked(body: bytes) -> bytes:
        head = f"POST {api.EMBEDDINGS_PATH} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        return head.encode() + b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 10]), body[i : i + 10])
                                        for i in range(0, len(body), 10)) + b"0\r\n\r\n"  # fmt: skip

    reader, writer = await asyncio.open_connection(api.HOST, edge[1])
    writer.write(chunked(BODY))
    assert (await reply(reader))[0] == 200
    writer.write(chunked(b" " * 2048))  # over the limit, with no length declared
    assert (await reply(reader))[0] == 413
    assert await closed(reader)


async def test_expect_continue_is_answered_before_the_body(edge: tuple[HttpServer, int]) -> None:
    reader, writer = await asyncio.open_connection(api.HOST, edge[1])
    head = post(BODY, api.EMBEDDINGS_PATH, "expect: 100-continue")
    writer.write(head[: -len(BODY)])
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), PATIENCE_S) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(BODY)
    assert (await reply(reader))[0] == 200
    writer.close()


async def test_idle_and_slow_connections_are_closed() -> None:
    server, port = await serving(Limits(idle_s=0.2, request_s=0.2))
    try:
        idle_reader, idle = await asyncio.open_connection(api.HOST, port)
        idle.write(post(BODY))
        assert (await reply(idle_reader))[0] == 200
        slow_reader, slow = await asyncio.open_connection(api.HOST, port)
        slow.write(post(BODY)[:20])  # a request begun and never finished (slowloris)
        assert await closed(idle_reader)
        assert (await reply(slow_reader))[0] == 408
        assert await closed(slow_reader)
    finally:
        await server.stop()


async def test_stop_refuses_new_connections_and_finishes_the_request_in_flight() -> None:
    server, port = await serving(Limits())
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(body: bytes) -> tuple[int, bytes]:
        entered.set()
        await release.wait()
        return 200, b"{}"

    server.routes[(b"POST", b"/slow")] = slow
    busy_reader, busy = await asyncio.open_connection(api.HOST, port)
    idle_reader, _ = await asyncio.open_connection(api.HOST, port)
    busy.write(post(b"{}", "/slow"))
    await asyncio.wait_for(entered.wait(), PATIENCE_S)
    stopping = asyncio.create_task(server.stop())
    assert await closed(idle_reader)  # nothing in flight there: closed at once
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(api.HOST, port)
    assert not stopping.done()
    release.set()
    status, headers, _ = await reply(busy_reader)
    assert (status, headers.get("connection")) == (200, "close")
    await asyncio.wait_for(stopping, PATIENCE_S)
