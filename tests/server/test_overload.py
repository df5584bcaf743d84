"""Offered load far above capacity, with the engine held (nothing computes until the checks are done):
refusals never wait for the engine, they carry a pushback, the queue stays bounded, every accepted
request is answered, a burst on one connection is refused at once however many calls it holds, and
a connection that calls again after hearing a refusal waits its pushback out instead of costing a
refusal a call. How fast refusals are is measured in ``bench.hostpath``, not here."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kembed.client import EmbedClient
from kembed.contract import RETRY_PUSHBACK_KEY
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


async def test_refusals_do_not_wait_for_the_engine_and_everything_accepted_is_answered(server: ServerProcess):
    """600 calls at once on one connection (an asyncio client, as a burst is sent): none waits for
    the engine, and none is held for its pushback, however many: none was sent after its client
    could have heard the refusal of the call before it."""
    calls = 600
    waits = server.metric("kembed_pushback_waits_total")
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        # One call first, on the same connection, so its front end learns the client's timeout from
        # a call it took at once (what places a burst's calls by receipt: kembed/frontend/pushback.py).
        await stub.Embed(REQUEST, timeout=120)
        with server.engine:
            futures = [asyncio.ensure_future(stub.Embed(REQUEST, timeout=120)) for _ in range(calls)]
            # Every call is decided while the engine computes nothing: refused, or admitted and waiting.
            decided = lambda: sum(f.done() for f in futures) + server.health()["open_requests"] == calls  # noqa: E731
            await asyncio.to_thread(wait_until, decided, 120, "every call decided")
            refused = [f for f in futures if f.done()]
            admitted = calls - len(refused)
            assert {code(f) for f in refused} == {EXHAUSTED}
            assert admitted >= 1 and len(refused) >= calls // 2
            assert server.metric("kembed_pushback_waits_total") == waits
            assert int(dict(refused[0].exception().trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
            assert server.health()["queued_tokens"] <= MAX_QUEUED
        await asyncio.gather(*futures, return_exceptions=True)
    codes = [code(f) for f in futures]
    assert (codes.count(OK), codes.count(EXHAUSTED)) == (admitted, len(refused))  # nothing lost, nothing else
    drain_time = 'kembed_rejected_total{{priority="{}",reason="drain_time"}}'
    assert server.metric(drain_time.format("interactive")) + server.metric(drain_time.format("batch")) > 0
    with EmbedClient(server.target) as client:
        assert client.embed(["the server recovers"]).shape == (1, 384)


def code(call: asyncio.Future[Any]) -> grpc.StatusCode:
    error = call.exception()
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else OK


def test_a_connection_that_calls_again_after_hearing_a_refusal_waits_it_out(server: ServerProcess):
    waits = server.metric("kembed_pushback_waits_total")
    held = lambda: server.metric("kembed_pushback_waits_total") > waits  # noqa: E731
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            backlog = [stub.Embed.future(REQUEST, timeout=120) for _ in range(40)]  # more than the budget holds
            wait_until(lambda: all_decided(server, backlog), 120, "a backlog")
            assert any(f.done() and f.code() == EXHAUSTED for f in backlog)
            again = []
            while not held():  # each refusal heard, the client calls again at once, ignoring its pushback
                again.append(stub.Embed.future(REQUEST, timeout=120))
                wait_until(lambda: again[-1].done() or held(), 120, "refused or held")
        # Released when the engine has room or its window ends: admitted or refused, none lost.
        codes = {f.code() for f in [*backlog, *again]}
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
