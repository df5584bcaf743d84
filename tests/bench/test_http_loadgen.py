"""bench.tools.http_loadgen against a tiny local HTTP server that answers in every framing it must read."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from bench.tools import http_loadgen
from bench.tools.loadgen import CallRecord

OK_BODY = b'{"object":"list","data":[]}'


def _reply(status: int, body: bytes, *extra: str) -> bytes:
    reason = {200: "OK", 429: "Too Many Requests"}[status]
    head = "".join(f"{h}\r\n" for h in (f"HTTP/1.1 {status} {reason}", "content-type: application/json", *extra))
    return head.encode() + b"\r\n" + body


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]))
    return _reply(200, chunks + b"0\r\nx-trailer: 1\r\n\r\n", "transfer-encoding: chunked")


# The n-th reply of the server, whatever the connection: every framing the client must read.
SCRIPT: list[Callable[[], tuple[bytes, bool]]] = [
    lambda: (_reply(200, OK_BODY, f"content-length: {len(OK_BODY)}"), True),
    lambda: (_chunked(OK_BODY), True),
    lambda: (_reply(429, b"{}", "content-length: 2"), True),
    lambda: (_reply(200, OK_BODY, f"content-length: {len(OK_BODY)}", "connection: close"), False),
]


@dataclass
class TinyServer:
    url: str = ""
    bodies: list[bytes] = field(default_factory=list)
    connections: int = 0
    replies: itertools.count[int] = field(default_factory=itertools.count)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))  # fmt: skip
                self.bodies.append(await reader.readexactly(length))
                reply, keep_open = SCRIPT[next(self.replies) % len(SCRIPT)]()
                writer.write(reply)
                await writer.drain()
                if not keep_open:
                    break
        except asyncio.IncompleteReadError:
            pass  # the client closed
        finally:
            writer.close()


@pytest.fixture
async def tiny_server() -> AsyncIterator[TinyServer]:
    state = TinyServer()
    server = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/embeddings"
    async with server:
        yield state


async def test_closed_loop_reads_every_framing_and_counts_codes(tiny_server: TinyServer) -> None:
    bodies = http_loadgen.embeddings_bodies(["a", "b", "c"], 1, "m", "float")
    requests = [http_loadgen.post_request(tiny_server.url, b) for b in bodies]
    outcomes = await http_loadgen.closed_loop(
        tiny_server.url, requests, connections=4, duration=600, count=40, deadline=60
    )
    assert len(outcomes) == 40  # the count bound, long before the time bound
    assert sorted(o.item for o in outcomes) == list(range(40))
    assert {o.code for o in outcomes} == {"200", "429"}
    assert sum(o.code == "429" for o in outcomes) == 10
    assert all(o.done >= o.sent >= 0 for o in outcomes)
    # Every request arrived whole (a misread reply would have desynchronised a connection).
    assert [json.loads(b)["model"] for b in tiny_server.bodies] == ["m"] * 40
    # Kept alive, except after each "connection: close" (every 4th reply), the last one ending the run.
    assert tiny_server.connections == 4 + 9


async def test_a_call_left_unanswered_times_out_and_a_broken_reply_is_an_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers

    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")
        writer.close()

    for handler, code in ((silent, http_loadgen.TIMEOUT), (broken, http_loadgen.ERROR)):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/embeddings"
        async with server:
            request = http_loadgen.post_request(url, b"{}")
            outcomes = await http_loadgen.closed_loop(
                url, [request], connections=1, duration=600, count=2, deadline=0.2
            )
        assert [o.code for o in outcomes] == [code, code]


def test_bodies_and_request_bytes() -> None:
    one, two = http_loadgen.embeddings_bodies(["x", "y", "z", "w"], 2, "m", "base64")
    assert json.loads(one) == {"input": ["x", "y"], "model": "m", "encoding_format": "base64"}
    assert json.loads(two)["input"] == ["z", "w"]
    assert json.loads(http_loadgen.embeddings_bodies(["x"], 1, "m", "float")[0])["input"] == "x"
    request = http_loadgen.post_request("http://h:8/v1/embeddings?a=1", b"{}")
    assert request.startswith(b"POST /v1/embeddings?a=1 HTTP/1.1\r\nhost: h:8\r\n")
    assert request.endswith(b"content-length: 2\r\n\r\n{}")
    with pytest.raises(ValueError, match="url"):
        http_loadgen._endpoint("https://h/v1/embeddings")


def test_summary_counts_rates_after_warmup_and_latency_of_successes() -> None:
    outcomes = [CallRecord(i, t, t, t + 0.01, "200") for i, t in enumerate([0.5, 1.5, 2.5, 2.6, 3.5])]
    outcomes.append(CallRecord(9, 3.0, 3.0, 3.9, "503"))
    summary = http_loadgen.summarize(outcomes, warmup=1.0, duration=5.0, windows=4)
    assert summary["codes"] == {"200": 5, "503": 1}
    assert summary["calls"] == 6
    assert summary["calls_per_s"] == {"median": 1.0, "lo": 0.0, "hi": 2.0}  # windows: 1, 2, 1, 0
    assert summary["latency_ms"]["max"] == pytest.approx(10.0)  # the 503 is not a latency of success
