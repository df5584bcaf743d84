"""Offered load far above capacity, with the engine held (nothing computes until the checks are done):
refusals never wait for the engine, they carry a pushback, the queue stays bounded, every accepted
request is answered, and a connection that ignores its pushback waits it out instead of costing a
refusal a call. How fast refusals are is measured in ``bench.hostpath``, not here."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from kembed.client import EmbedClient
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.frontend.pushback import REFUSALS_AT_ONCE
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, all_decided, wait_until

MAX_QUEUED = 16_384
MAX_DRAIN_MS = 1000  # a few requests fit in the drain budget, whatever this machine's speed
SENTENCE = "Admission control rejects early instead of queueing into timeouts and memory exhaustion."
REQUEST = pb.EmbedRequest(texts=[SENTENCE] * 8)  # 8 items in the 32 bucket: 256 padded tokens
OK, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("overload") / "server.log"
    running = ServerProcess(
        log, held=True, frontends=2, max_drain_ms=MAX_DRAIN_MS, max_queued_tokens=MAX_QUEUED, p95_soft_ms=1500
    )
    yield running.wait_ready()
    running.stop()


def test_refusals_do_not_wait_for_the_engine_and_everything_accepted_is_answered(server: ServerProcess):
    calls = REFUSALS_AT_ONCE - 28  # one connection, all refused at once: below its allowance
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            futures = [stub.Embed.future(REQUEST, timeout=120) for _ in range(calls)]
            # Every call is decided while the engine computes nothing: refused, or admitted and waiting.
            wait_until(lambda: all_decided(server, futures), 120, "every call decided")
            refused = [f for f in futures if f.done()]
            admitted = calls - len(refused)
            assert {f.code() for f in refused} == {EXHAUSTED}
            assert admitted >= 1 and len(refused) >= calls // 2
            assert server.health()["queued_tokens"] <= MAX_QUEUED
            assert int(dict(refused[0].trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
        codes = [f.code() for f in futures]
    assert (codes.count(OK), codes.count(EXHAUSTED)) == (admitted, len(refused))  # nothing lost, nothing else
    assert server.metric('kembed_rejected_total{priority="interactive",reason="drain_time"}') > 0
    with EmbedClient(server.target) as client:
        assert client.embed(["the server recovers"]).shape == (1, 384)


def test_a_connection_that_ignores_its_pushback_waits_it_out(server: ServerProcess):
    waits = server.metric("kembed_pushback_waits_total")
    calls = REFUSALS_AT_ONCE + 72
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            futures = [stub.Embed.future(REQUEST, timeout=120) for _ in range(calls)]
            # Past the refusals a burst may get at once, the connection's calls wait: not refused, not admitted.
            wait_until(lambda: server.metric("kembed_pushback_waits_total") > waits, 120, "calls held")
            assert sum(f.done() for f in futures) >= REFUSALS_AT_ONCE
        # Released when the engine has room or their window ends: admitted or refused, none lost.
        codes = {f.code() for f in futures}
    assert codes <= {OK, EXHAUSTED} and OK in codes


def test_client_retries_after_the_pushback(server: ServerProcess):
    client = EmbedClient(server.target, timeout_s=300, max_attempts=1000)
    with grpc.insecure_channel(server.target) as channel, client:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            backlog = [stub.Embed.future(REQUEST, timeout=120) for _ in range(40)]  # more than the budget holds
            wait_until(lambda: all_decided(server, backlog), 120, "a backlog")
            assert any(f.done() for f in backlog)  # refused: no room for one more such request
            answer: list[tuple[int, ...]] = []
            retrying = threading.Thread(target=lambda: answer.append(client.embed(list(REQUEST.texts)).shape))
            retrying.start()
            wait_until(lambda: client.retries >= 1, 120, "the client refused and retrying")
        retrying.join(timeout=300)
    assert answer == [(8, 384)]
