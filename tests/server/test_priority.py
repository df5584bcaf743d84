"""Both priority classes end to end over gRPC, with the engine held (nothing computes until the
checks are done): batch work fills the queue and is refused first; an interactive call on the same
connection is admitted in the place of the youngest batch call not started, which hears why and
when to come back; once released, the interactive call is computed before the batch work queued
ahead of it; the metrics count each class."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest

from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, server_fixture, wait_until

SENTENCE = "Admission control rejects early instead of queueing into timeouts and memory exhaustion."
TEXTS = [SENTENCE] * 8  # 8 items in the 32 bucket: 256 padded tokens
BATCH = pb.EmbedRequest(texts=TEXTS, priority=pb.PRIORITY_BATCH)
QUERY = pb.EmbedRequest(texts=TEXTS)  # interactive, as every request that sets no priority
MAX_QUEUED = 8 * 256  # the cap, not the drain budget, bounds the queue here
OK, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
Call = Any  # a call's future: code(), details(), trailing_metadata() (the stubs type it as Any)

pytestmark = pytest.mark.process


# One compute lane: the order calls finish in is the order their batches started. With two, a
# batch started beside the query can finish before it, and on a loaded machine a second one.
server = server_fixture(held=True, frontends=1, compute_lanes=1, max_drain_ms=600_000, max_queued_tokens=MAX_QUEUED)


def fill_with_batch_work(server: ServerProcess, stub: pb_grpc.EmbedderStub) -> tuple[list[Call], Call]:
    """One batch call at a time until the queue cap refuses one: the calls admitted, and the refused one."""
    admitted: list[Call] = []
    while True:
        call = stub.Embed.future(BATCH, timeout=300)

        def decided(call: Call = call) -> bool:
            return call.done() or server.health()["open_requests"] > len(admitted)

        wait_until(decided, 120, "a decision")
        if call.done():
            return admitted, call
        admitted.append(call)


def test_batch_work_is_refused_first_and_gives_its_place_and_its_turn_to_interactive_work(server: ServerProcess):
    done: list[Call] = []
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:
            admitted, refused = fill_with_batch_work(server, stub)
            for call in admitted:
                call.add_done_callback(done.append)
            assert refused.code() == EXHAUSTED and int(dict(refused.trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
            running = int(server.metric("kembed_running_requests"))  # in the lane's hands
            assert running >= 1 and len(admitted) >= running + 2  # and the others waiting
            assert server.health()["waiting_requests"] == {"interactive": 0, "batch": len(admitted) - running}

            query = stub.Embed.future(QUERY, timeout=300)  # the same connection: its batch pushback is not the query's
            query.add_done_callback(done.append)
            displaced = admitted.pop()  # the youngest batch call not started
            wait_until(displaced.done, 120, "the youngest batch call displaced")
            assert displaced.code() == EXHAUSTED and "gave its place" in (displaced.details() or "")
            assert int(dict(displaced.trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
            assert server.health()["waiting_requests"] == {"interactive": 1, "batch": len(admitted) - running}
            assert server.metric('kembed_waiting_requests{priority="batch"}') == len(admitted) - running
            assert server.metric("kembed_running_requests") == running
            assert 0 < server.metric("kembed_saturation") <= 1
        # Released: the batches in the worker's hands finish, then the query goes before the rest.
        wait_until(lambda: query.done() and all(call.done() for call in admitted), 300, "every call answered")
    assert query.code() == OK and {call.code() for call in admitted} == {OK}
    order = [call for call in done if call is not displaced]
    assert order.index(query) <= running, "the query waited for batch work queued before it"
    assert server.metric('kembed_rejected_total{priority="batch",reason="displaced"}') == 1
    assert server.metric('kembed_rejected_total{priority="batch",reason="queue_full"}') >= 1
    assert server.metric('kembed_rejected_total{priority="interactive",reason="queue_full"}') == 0


def test_an_unknown_priority_is_refused_naming_the_field(server: ServerProcess):
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["x"], priority=cast(Any, 7)), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("priority")
