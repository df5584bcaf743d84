"""The library's pacing and its one deadline: a list of any length through a server that admits
little at once (a small drain budget), answered whole and in order without spending the retry
budget on the client's own window; and ``timeout_s`` bounding a whole call, its retries and
pushbacks included, against a gRPC server over loopback that refuses as told."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kembed.client import AsyncEmbedClient, EmbedClient, Refused, Unavailable
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.in_process import served
from tests.server.serving import ServerProcess, server_fixture

TOPICS = ["pods", "nodes", "vectors", "queues", "tokens", "shards", "replicas", "graphs"]
# Three requests' worth (1,024 texts a request): more than the server's budget takes at once.
MANY = [f"note {i} on {TOPICS[i % 8]} and {TOPICS[i * 7 % 8]}" for i in range(2_100)]
SAMPLED = [0, 1, 1_023, 1_024, 2_099]  # rows compared with the text embedded alone


class Refusing(pb_grpc.EmbedderServicer):
    """Answers Info; refuses every Embed after ``delay_s`` with a pushback of ``pushback_ms``, and
    notes the time each attempt had left when it arrived."""

    def __init__(self, delay_s: float, pushback_ms: int) -> None:
        self.delay_s = delay_s
        self.pushback_ms = pushback_ms
        self.time_left: list[float] = []

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(model_id="refusing", dimensions=4, max_batch_items=1024)

    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        self.time_left.append(context.time_remaining() or 0.0)
        time.sleep(self.delay_s)
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(self.pushback_ms)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "server is overloaded: as the test says")


def refusing(delay_s: float, pushback_ms: int) -> Iterator[tuple[str, Refusing]]:
    servicer = Refusing(delay_s, pushback_ms)
    with served(servicer) as target:
        yield target, servicer


@pytest.fixture
def slow_refusals() -> Iterator[tuple[str, Refusing]]:
    """Refused after 1 s, told to come back in 0.1 s: a retry fits a 1.5 s deadline, a second does not."""
    yield from refusing(1.0, 100)


@pytest.fixture
def long_pushback() -> Iterator[tuple[str, Refusing]]:
    yield from refusing(0.0, 60_000)


def test_timeout_s_is_one_deadline_for_the_whole_call(slow_refusals: tuple[str, Refusing]):
    target, servicer = slow_refusals
    with EmbedClient(target, timeout_s=1.5) as client, pytest.raises(Unavailable) as failed:
        client.embed(["hello"])
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(servicer.time_left) == 2  # the retry went with what was left of the 1.5 s, not 1.5 s again
    assert servicer.time_left[1] < 1.0, servicer.time_left  # what the server saw: no wall clock here


def test_the_async_client_keeps_the_same_deadline(slow_refusals: tuple[str, Refusing]):
    target, servicer = slow_refusals

    async def embed() -> None:
        async with AsyncEmbedClient(target, timeout_s=1.5) as client:
            await client.embed(["hello"])

    with pytest.raises(Unavailable):
        asyncio.run(embed())
    assert len(servicer.time_left) == 2 and servicer.time_left[1] < 1.0, servicer.time_left


def test_a_pushback_past_the_deadline_ends_the_call_with_the_refusal(long_pushback: tuple[str, Refusing]):
    target, servicer = long_pushback
    with EmbedClient(target, timeout_s=5) as client, pytest.raises(Refused) as refused:
        client.embed(["hello"])
    assert len(servicer.time_left) == 1  # not waited for: 60 s is past what is left of 5 s
    assert refused.value.retry_after_s == 60.0
    assert str(refused.value) == "RESOURCE_EXHAUSTED: server is overloaded: as the test says"
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


# --- a server that admits little at once ----------------------------------------------------------


# A drain budget of 1 s: a request of 1,024 texts (the most a request may carry; some 15,000
# padded tokens, 10 s and more on two busy cores) is far over it; the client cuts its parts to what
# Info says the budget admits, and any refusal of its own part beside others is paced, not retried.
tight_server = server_fixture(admission="throughput", max_drain_ms=1000)


@pytest.mark.process
@pytest.mark.timeout(1200)  # a server's start and 2,100 texts at a 1 s budget: minutes on two busy cores
def test_embed_paces_thousands_of_texts_through_a_small_budget(tight_server: ServerProcess):
    with EmbedClient(tight_server.target) as client:
        vectors = client.embed(MANY)
        assert client.retries == 0  # a refusal of its own part beside others spends no retry budget
        alone = np.concatenate([client.embed([MANY[i]]) for i in SAMPLED])
    assert vectors.shape == (len(MANY), 384)
    np.testing.assert_allclose(vectors[SAMPLED], alone, atol=1e-5)  # row for row, in input order


@pytest.mark.process
@pytest.mark.timeout(1200)
def test_the_async_client_paces_alike(tight_server: ServerProcess):
    async def embed() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncEmbedClient(tight_server.target) as client:
            both = await asyncio.gather(client.embed(MANY[:1500]), client.embed(MANY[1500:], dimensions=64))
            return both[0], both[1]

    first, second = asyncio.run(embed())
    with EmbedClient(tight_server.target) as client:
        alone = client.embed([MANY[1499], MANY[-1]], dimensions=64)
    assert first.shape == (1500, 384) and second.shape == (600, 64)
    np.testing.assert_allclose(first[1499, :64] / np.linalg.norm(first[1499, :64]), alone[0], atol=1e-5)
    np.testing.assert_allclose(second[599], alone[1], atol=1e-5)
