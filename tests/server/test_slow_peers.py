"""Peers that stop reading, on a real server: a gRPC client that never reads its stream. What the
server holds for it stays bounded, and everyone else is still answered."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kembed.contract import Metric
from kembed.frontend.service import MAX_STREAM_REQUESTS, MAX_STREAM_ROWS
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, wait_until

pytestmark = pytest.mark.slow

MAX_ITEMS = 64
OK_ANSWERS = f'{Metric.REQUESTS}_total{{code="OK"}}'
# Without BDP probing a client's HTTP/2 receive window stays at 64 KiB: answers in it have left the
# server. The stream's and the connection's windows are counted apart, each with a partial answer.
CLIENT_WINDOW_BYTES = 2 * 65535


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("slow") / "server.log"
    running = ServerProcess(log, frontends=1, admission="", max_items_per_request=MAX_ITEMS)
    yield running.wait_ready()
    running.stop()


@pytest.mark.parametrize("texts", [1, MAX_ITEMS], ids=["requests bound", "rows bound"])
def test_a_client_that_never_reads_holds_a_bounded_stream(server: ServerProcess, texts: int):
    request = pb.EmbedRequest(texts=["nobody reads this"] * texts)
    held = min(MAX_STREAM_REQUESTS, MAX_STREAM_ROWS // texts)
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
