"""Offered load far above capacity, with the engine held (nothing computes until the checks are done):
refusals never wait for the engine, they carry a pushback, the queue stays bounded, every accepted
request is answered, a burst on one connection is refused at once however many calls it holds, and
a connection refused past its burst is answered at its refusal rate while others are answered at
once. How fast refusals are is measured in ``bench.serving.hostpath``, not here."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest

from kembed.client import EmbedClient
from kembed.client.embed_client import RetryBudget
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.policy.load import MIN_LATENCY_SAMPLES
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, all_decided, server_fixture, wait_until

MAX_QUEUED = 16_384
MAX_DRAIN_MS = 1000  # a few requests fit in the drain budget, whatever this machine's speed
REFUSAL_BURST = 700  # more than the burst below; the storm below goes past it
SENTENCE = "Admission control rejects early instead of queueing into timeouts and memory exhaustion."
REQUEST = pb.EmbedRequest(texts=[SENTENCE] * 8)  # 8 items in the 32 bucket: 256 padded tokens
# The same as batch work, which waits behind everything: refused behind a full backlog whatever the
# measured rate (at a low one, interactive requests of this size are served as batch work, which a
# query does not wait behind).
INGEST = pb.EmbedRequest(texts=[SENTENCE] * 8, priority=pb.PRIORITY_BATCH)
ONE_TEXT, ONE_TEXT_TOKENS = pb.EmbedRequest(texts=[SENTENCE]), 32  # padded
OK, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
PACED = "kembed_refusals_paced_total"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # channels otherwise share one connection

pytestmark = pytest.mark.process


server = server_fixture(
    held=True,
    frontends=2,
    max_drain_ms=MAX_DRAIN_MS,
    max_queued_tokens=MAX_QUEUED,
    p95_soft_ms=1500,
    refusal_burst=REFUSAL_BURST,
    refusal_rate=1,  # refusals a second past the burst: a test machine refuses faster
)


async def test_refusals_do_not_wait_for_the_engine_and_everything_accepted_is_answered(server: ServerProcess):
    """600 calls at once on one connection (an asyncio client, as a burst is sent): none waits for
    the engine, and every refusal is answered at once (within the connection's refusal burst),
    however late the front end gets to it."""
    calls = 600
    paced = server.metric(PACED)
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        await channel.channel_ready()
        with server.engine:
            futures = [asyncio.ensure_future(stub.Embed(REQUEST, timeout=120)) for _ in range(calls)]
            # Every call is decided while the engine computes nothing: refused, or admitted and waiting.
            decided = lambda: sum(f.done() for f in futures) + server.health()["open_requests"] == calls  # noqa: E731
            await asyncio.to_thread(wait_until, decided, 120, "every call decided")
            refused = [f for f in futures if f.done()]
            admitted = calls - len(refused)
            assert {code(f) for f in refused} == {EXHAUSTED}
            assert admitted >= 1 and len(refused) >= calls // 2
            assert server.metric(PACED) == paced
            assert int(dict(refused[0].exception().trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
            health = server.health()
            assert health["queued_tokens"] <= MAX_QUEUED
            # /health says the pod refuses (issue 59: it said "healthy" while refusing 96% of a burst),
            # and readiness stays: a refusing pod still serves what it admits.
            assert health["saturated"] and health["refusals"]["refused"] >= len(refused), health
            assert health["status"] in ("saturated", "degraded", "overloaded") and server.http("/readyz")[0] == 200
        await asyncio.gather(*futures, return_exceptions=True)
    codes = [code(f) for f in futures]
    assert (codes.count(OK), codes.count(EXHAUSTED)) == (admitted, len(refused))  # nothing lost, nothing else
    drain_time = 'kembed_rejected_total{{priority="{}",reason="drain_time"}}'
    assert server.metric(drain_time.format("interactive")) + server.metric(drain_time.format("batch")) > 0
    with EmbedClient(server.target) as client:
        assert client.embed(["the server recovers"]).shape == (1, 384)
    # Once no call was refused for a window, it is healthy again.
    wait_until(lambda: server.health()["status"] == "healthy", 120, "healthy again")
    assert server.health()["saturated"] is False


def code(call: asyncio.Future[Any]) -> grpc.StatusCode:
    error = call.exception()
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else OK


def test_a_connection_refused_past_its_burst_is_paced_and_its_neighbours_are_not(server: ServerProcess):
    """A client that keeps calling while refused, as a retry storm does: past its refusal burst its
    refusals are answered at its rate (paced), and every call is still answered. A second
    connection meanwhile is answered at once."""
    with (
        grpc.insecure_channel(server.target, OWN_CONNECTION) as storm,
        grpc.insecure_channel(server.target, OWN_CONNECTION) as neighbour,
    ):
        with server.engine:
            backlog = [pb_grpc.EmbedderStub(storm).Embed.future(REQUEST, timeout=120) for _ in range(40)]
            wait_until(lambda: all_decided(server, backlog), 120, "a backlog")
            paced = server.metric(PACED)
            retries = [pb_grpc.EmbedderStub(storm).Embed.future(REQUEST, timeout=120) for _ in range(REFUSAL_BURST)]
            wait_until(lambda: all(f.done() for f in retries), 120, "the retries refused")
            assert {f.code() for f in retries} == {EXHAUSTED}
            assert server.metric(PACED) > paced
            paced = server.metric(PACED)
            others = [pb_grpc.EmbedderStub(neighbour).Embed.future(REQUEST, timeout=120) for _ in range(20)]
            wait_until(lambda: all(f.done() for f in others), 120, "the neighbour refused")
            assert {f.code() for f in others} == {EXHAUSTED}
            assert server.metric(PACED) == paced
        assert {f.code() for f in backlog} <= {OK, EXHAUSTED}


def held_backlog(
    server: ServerProcess, stub: pb_grpc.EmbedderStub, room_for: int = 1, share: float = 1.0
) -> tuple[list[Any], float]:
    """One-text queries admitted into the held engine while ``share`` of the drain budget has room
    for ``room_for`` more (whatever this machine's rate), and the drain time they make (seconds).
    Small, so that none is served as batch work, which a query would not wait behind."""
    backlog: list[Any] = []
    health = server.health()
    admitted = health["open_requests"]
    room = lambda tokens: 2 * tokens / health["service_rate_tokens_per_sec"] < share * MAX_DRAIN_MS / 1000  # noqa: E731
    while room(health["queued_tokens"] + (1 + room_for) * ONE_TEXT_TOKENS):
        backlog.append(stub.Embed.future(ONE_TEXT, timeout=120))
        server.wait_open_requests(admitted + len(backlog))
        health = server.health()
    return backlog, health["estimated_drain_time_ms"] / 1000


def test_a_call_whose_deadline_ends_before_its_turn_is_refused_at_once(server: ServerProcess):
    """A deadline shorter than the wait ahead: refused now with a pushback, not queued to expire."""
    late = 'kembed_rejected_total{priority="interactive",reason="deadline"}'
    refusals = server.metric(late)
    with grpc.insecure_channel(server.target, OWN_CONNECTION) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            backlog, drain_s = held_backlog(server, stub)
            assert backlog and drain_s > 0
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(ONE_TEXT, timeout=drain_s * 0.8)
            assert refused.value.code() == EXHAUSTED
            assert "deadline" in (refused.value.details() or "")
            assert server.metric(late) == refusals + 1
        assert {f.result() is not None for f in backlog} == {True}


def test_calls_whose_clients_leave_count_in_the_p95_at_their_expected_wait(server: ServerProcess):
    """Clients that leave while their calls are queued (as careless deadlines do) do not pull the
    exported P95 down to how long they stayed: their calls count at the wait they were admitted to."""
    leaving_calls = MIN_LATENCY_SAMPLES  # the fewest the P95 is computed from
    wait_until(lambda: server.health()["p95_server_side_latency_ms"] == 0, 120, "an empty latency window")
    with grpc.insecure_channel(server.target, OWN_CONNECTION) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            # Half the budget: the leaving calls are admitted however the board lags.
            backlog, drain_s = held_backlog(server, stub, room_for=leaving_calls, share=0.5)
            leaving = [stub.Embed.future(ONE_TEXT, timeout=120) for _ in range(leaving_calls)]
            wait_until(lambda: all_decided(server, [*backlog, *leaving]), 120, "the leaving calls decided")
            if any(call.done() for call in leaving):  # a machine so loaded its measured rate has no room
                pytest.skip("the drain budget had no room for five one-text queries at this machine's rate")
            for call in leaving:
                call.cancel()
            wait_until(lambda: server.health()["p95_server_side_latency_ms"] > 0, 120, "the cancelled calls counted")
            assert server.health()["p95_server_side_latency_ms"] >= drain_s * 1000
        assert {f.result() is not None for f in backlog} == {True}


def test_a_client_refused_again_and_again_stops_retrying(server: ServerProcess):
    """kembed's client throttles its retries (gRPC's retryThrottling): refused every time, it gives
    up after a few retries instead of retrying for its whole timeout."""
    client = EmbedClient(server.target, timeout_s=300, max_attempts=1000)
    with grpc.insecure_channel(server.target) as channel, client, server.engine:
        backlog = [pb_grpc.EmbedderStub(channel).Embed.future(INGEST, timeout=120) for _ in range(40)]
        wait_until(lambda: all_decided(server, backlog), 120, "a backlog")
        with pytest.raises(grpc.RpcError) as refused:  # one request as it is: embed would shrink its part
            client.embed_request(INGEST)  # until a text fits the held engine, and wait there instead
    assert refused.value.code() == EXHAUSTED
    assert client.retries == 4  # 10 tokens: retried at 9, 8, 7 and 6 left


def test_client_retries_after_the_pushback(server: ServerProcess):
    # Retried for as long as it takes: throttling is the test above's.
    client = EmbedClient(server.target, timeout_s=300, max_attempts=1000, retry_budget=RetryBudget(max_tokens=1000))
    with grpc.insecure_channel(server.target) as channel, client:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            backlog = [stub.Embed.future(INGEST, timeout=120) for _ in range(40)]  # more than the budget holds
            wait_until(lambda: all_decided(server, backlog), 120, "a backlog")
            assert any(f.done() for f in backlog)  # refused: no room for one more such request
            answer: list[tuple[int, ...]] = []
            ingest = lambda: answer.append(client.embed(list(INGEST.texts), priority="batch").shape)  # noqa: E731
            retrying = threading.Thread(target=ingest)
            retrying.start()
            # Refused and retrying, or (a front end that saw the board a moment late) admitted into the
            # held engine: answered once it computes, either way.
            admitted = server.health()["open_requests"]
            went_on = lambda: client.retries >= 1 or server.health()["open_requests"] > admitted  # noqa: E731
            wait_until(went_on, 120, "a retry or an admission")
        retrying.join(timeout=300)
    assert answer == [(8, 384)]
