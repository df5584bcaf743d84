"""Peers that stop reading, on a real server: a gRPC client that never reads its stream, a front end
that never reads the engine's answers, HTTP clients that connect and say nothing. What the server
holds for each stays bounded, and everyone else is still answered."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from pathlib import Path

import grpc
import pytest

from kembed.config.settings import Settings
from kembed.contract import Metric
from kembed.frontend.grpc_slots import MAX_STREAM_REQUESTS
from kembed.ipc.protocol import PROTOCOL_VERSION, Hello, send
from kembed.plumbing.runtime import ENGINE_SOCKET
from kembed.supervisor.http import MAX_CONNECTIONS
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.queueing import work
from tests.server.serving import FAST, ServerProcess, rss_bytes, server_fixture, wait_until

pytestmark = pytest.mark.process

MAX_ITEMS = 64
OK_ANSWERS = f'{Metric.REQUESTS}_total{{api="grpc",code="OK"}}'
# Without BDP probing a client's HTTP/2 receive window stays at 64 KiB: answers in it have left the
# server. The stream's and the connection's windows are counted apart, each with a partial answer.
CLIENT_WINDOW_BYTES = 2 * 65535
# What the engine may hold for a front end that reads nothing: 8 MiB unsent, plus the answers of
# its queued work (at most the queue's 262,144 padded tokens: 16,384 rows of 1.5 KiB), and room
# for the allocator's noise. Without a bound it grows by megabytes a second (refusals of the work
# that overflows the queue, and answers).
ENGINE_GROWTH_BOUND = 128 * 1024 * 1024


server = server_fixture(frontends=1, admission="", max_items_per_request=MAX_ITEMS)


@pytest.mark.parametrize("texts", [1, MAX_ITEMS], ids=["requests bound", "bytes bound"])
def test_a_client_that_never_reads_holds_a_bounded_stream(server: ServerProcess, texts: int):
    request = pb.EmbedRequest(texts=["nobody reads this"] * texts)
    # A stream's window: one of the largest messages, of requests and their answers' float32 rows.
    weight = request.ByteSize() + texts * 384 * 4
    held = min(MAX_STREAM_REQUESTS, Settings().max_message_bytes // weight)
    with grpc.insecure_channel(server.target) as channel:
        in_window = CLIENT_WINDOW_BYTES // pb_grpc.EmbedderStub(channel).Embed(request).ByteSize() + 2
    offered = 4 * (held + in_window)  # without the bound, the server would compute all of them
    before = server.metric(OK_ANSWERS)
    silent = grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)])
    # Never read; its requests' deadline is the stream's, so none expires on a slow machine.
    stream = pb_grpc.EmbedderStub(silent).EmbedStream(iter([request] * offered), timeout=900)
    try:
        wait_until(lambda: server.metric(OK_ANSWERS) - before >= held, 600, "the stream to fill its window")
        others = 3
        with grpc.insecure_channel(server.target) as channel:
            for _ in range(others):  # each queues behind whatever the stream has in the engine
                assert pb_grpc.EmbedderStub(channel).Embed(request, timeout=600).count == texts
        computed = server.metric(OK_ANSWERS) - before - others
        assert held <= computed <= held + in_window, (computed, held, in_window)
    finally:
        stream.cancel()
        silent.close()


async def unreading_front_end(engine_socket: Path) -> None:
    """Connects to the engine as a front end does, then sends it work for good and reads nothing.
    Its work expires in seconds, so that work queued before the engine stops reading it leaves the
    queue soon; what overflows the queue is refused, and the refusals go unread too."""
    _, writer = await asyncio.open_unix_connection(str(engine_socket))
    buckets = [int(length) for length in str(FAST["buckets"]).split(",")]
    tags = itertools.count(1)
    send(writer, Hello(PROTOCOL_VERSION, 0))  # as front end 0, the one the board has cells for (no admission here)
    try:
        while True:
            frame_tags = list(itertools.islice(tags, 64))
            deadline = time.monotonic() + 2
            send(writer, work([[14]] * len(frame_tags), frame_tags, buckets, deadline))
            await writer.drain()  # once the engine stops reading, this waits for good
    finally:
        writer.transport.abort()  # close() would wait to send what the engine no longer reads


def answered(server: ServerProcess) -> bool:
    """One call through the real front end: answered, or refused while the queue is full."""
    with grpc.insecure_channel(server.target) as channel:
        try:
            return pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still here"]), timeout=120).count == 1
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
            raise


async def test_a_front_end_that_never_reads_stops_being_read(server: ServerProcess):
    stalls = f"{Metric.FRONTEND_STALLS}_total"
    engine = server.children()["engine"]
    baseline, stalled_before = rss_bytes(engine), server.metric(stalls)
    flood = asyncio.create_task(unreading_front_end(server.runtime() / ENGINE_SOCKET))
    try:
        await asyncio.to_thread(
            wait_until, lambda: server.metric(stalls) > stalled_before, 300, "the engine to stop reading it"
        )
        assert not flood.done()
        await asyncio.to_thread(wait_until, lambda: answered(server), 300, "another client to be answered")
        assert rss_bytes(engine) - baseline < ENGINE_GROWTH_BOUND
    finally:
        flood.cancel()


def test_idle_http_connections_are_closed_and_cannot_keep_the_probes_out(server: ServerProcess):
    idle = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(MAX_CONNECTIONS + 1)]
    try:
        idle[0].settimeout(60)
        assert idle[0].recv(1) == b""  # the oldest, closed to make room for the newest
        assert server.http("/readyz")[0] == 200
        idle[-1].settimeout(120)
        assert idle[-1].recv(1) == b""  # closed at its timeout
    finally:
        for connection in idle:
            connection.close()
