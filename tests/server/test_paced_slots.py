"""A paced refusal is a timer: it holds no call slot, connection or memory another client needs. A
client whose refusals are paced fills every gRPC call slot, and every REST connection, of a front
end with small limits; a second client, on its own connection, still gets its own admission decision
(refused because the queue is full, with a pushback), never the front end's concurrency limit or a
reset connection. The engine is held, so one admitted ingest fills the queue and every other ingest
is refused whatever this machine's speed."""

from __future__ import annotations

import http.client
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import orjson
import pytest

from kembed.config.settings import Settings
from kembed.contract import RETRY_PUSHBACK_KEY, Metric
from kembed.frontend.connections import IDLE_GRACE_S
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, server_fixture, wait_until

pytestmark = pytest.mark.process

CALL_SLOTS, CONNECTIONS, BURST = 32, 16, 16
# Past its burst a client's refusals are answered 5 s, then 10 s late (the longest): a storm holds
# its paced calls long after a neighbour has called.
RATE = 0.2
SENTENCE = "Admission control rejects early instead of queueing into timeouts and memory exhaustion."
INGEST = pb.EmbedRequest(texts=[SENTENCE] * 8, priority=pb.PRIORITY_BATCH)  # 256 padded tokens: the whole queue
INGEST_BODY = orjson.dumps({"input": [SENTENCE] * 8, "priority": "batch"})
PACED = "kembed_refusals_paced_total"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # channels otherwise share one connection
NEIGHBOUR_ADDRESS = "127.0.0.2"  # loopback too, but another REST client than 127.0.0.1
TOKENIZER_ADDRESS = "127.0.0.3"  # a client with a burst of its own
STORM_ADDRESS = "127.0.0.4"  # another
QUEUE_FULL = 'kembed_rejected_total{priority="batch",reason="queue_full"}'
INGEST_COST = 8 * 16  # padded tokens: its lower bound (12 words and 2 special tokens a text, in the 16 bucket)


server = server_fixture(
    held=True,
    frontends=1,
    max_concurrent_rpcs=CALL_SLOTS,
    max_rest_connections=CONNECTIONS,
    refusal_burst=BURST,
    refusal_rate=RATE,
    max_queued_tokens=256,
    max_drain_ms=600_000,  # only the queue's cap refuses
    p95_soft_ms=600_000,
    p95_hard_ms=600_000,
)


def test_paced_grpc_refusals_leave_the_call_slots_to_another_client(server: ServerProcess) -> None:
    """One connection's refusals paced past its burst, more of them than the front end has call
    slots: a neighbour's calls are each decided by admission, not refused for want of a slot."""
    with (
        grpc.insecure_channel(server.target, OWN_CONNECTION) as storm,
        grpc.insecure_channel(server.target, OWN_CONNECTION) as neighbour,
    ):
        storm_stub, neighbour_stub = pb_grpc.EmbedderStub(storm), pb_grpc.EmbedderStub(neighbour)
        with server.engine:
            backlog = storm_stub.Embed.future(INGEST, timeout=120)
            server.wait_open_requests(1)
            burst = [storm_stub.Embed.future(INGEST, timeout=120) for _ in range(BURST)]
            wait_until(lambda: all(f.done() for f in burst), 120, "the storm's burst refused")
            paced = server.metric(PACED)
            retries = [storm_stub.Embed.future(INGEST, timeout=120) for _ in range(CALL_SLOTS + 8)]
            # Every slot the backlog leaves: enough for the storm to take them all if paced calls kept theirs.
            wait_until(lambda: server.metric(PACED) >= paced + CALL_SLOTS - 1, 120, "the storm paced")
            others = [neighbour_stub.Embed.future(INGEST, timeout=120) for _ in range(12)]
            wait_until(lambda: all(f.done() for f in others), 120, "the neighbour answered")
            details = {f.details() for f in others}
            assert all("queue is full" in d for d in details), details
            assert all(RETRY_PUSHBACK_KEY in dict(f.trailing_metadata()) for f in others)
            assert server.metric(PACED) < paced + len(retries) + len(others)  # the neighbour's were not paced
        wait_until(lambda: all(f.done() for f in retries), 120, "the storm answered")
        assert {f.code() for f in retries} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert backlog.result().count == 8


def test_paced_rest_refusals_leave_the_connections_to_another_client(server: ServerProcess) -> None:
    """Every REST connection a front end holds carrying a paced refusal: a neighbour's new connection
    is taken (a paced one counts as idle, the first closed for room) and its call decided."""
    stop = threading.Event()
    with grpc.insecure_channel(server.target, OWN_CONNECTION) as channel:
        with server.engine:
            backlog = pb_grpc.EmbedderStub(channel).Embed.future(INGEST, timeout=120)
            server.wait_open_requests(1)
            paced = server.metric(PACED)
            storm = [threading.Thread(target=_call_until, args=(server, stop)) for _ in range(CONNECTIONS)]
            for thread in storm:
                thread.start()
            try:
                wait_until(lambda: server.metric(PACED) >= paced + CONNECTIONS, 120, "every storm connection paced")
                stop.wait(IDLE_GRACE_S + 0.5)  # the paced connections count as idle long enough to be closed
                answers = [_post(server, NEIGHBOUR_ADDRESS) for _ in range(10)]
            finally:
                stop.set()
            assert {status for status, _ in answers} == {429}, answers
            assert all("Retry-After" in headers for _, headers in answers)
        backlog.result()
    for thread in storm:
        thread.join()


def test_tokenize_is_admitted_and_paced_as_an_embedding_call_of_its_cost(server: ServerProcess) -> None:
    """``/tokenize`` was never admitted or paced: a client tokenizing large bodies back to back took
    the cores from everyone. While the queue is full it is refused as an embedding call of its cost
    is, past its client's burst paced; a small one is admitted."""
    with grpc.insecure_channel(server.target, OWN_CONNECTION) as channel:
        with server.engine:
            backlog = pb_grpc.EmbedderStub(channel).Embed.future(INGEST, timeout=120)
            server.wait_open_requests(1)
            paced = server.metric(PACED)
            answers = [_post(server, TOKENIZER_ADDRESS, "/tokenize") for _ in range(BURST + 1)]
            assert {status for status, _ in answers} == {429}, answers
            assert server.metric(PACED) == paced + 1  # the one past the burst
            assert _post(server, TOKENIZER_ADDRESS, "/tokenize", orjson.dumps({"input": "a query"}))[0] == 200
        assert backlog.result().count == 8


def test_a_client_paced_for_ignoring_its_pushback_has_its_refusals_past_its_burst_uncounted(
    server: ServerProcess,
) -> None:
    """Refused calls sent again at once, with no retry marker: past its burst a client's refusals
    are retries in all but the marker, and the demand counts them no more (925 KB bodies re-sent
    back to back read 133 times the pod's capacity). Its burst, and the call at its edge, count."""
    extra = 10
    with grpc.insecure_channel(server.target, OWN_CONNECTION) as channel:
        with server.engine:
            backlog = pb_grpc.EmbedderStub(channel).Embed.future(INGEST, timeout=120)
            server.wait_open_requests(1)
            refused, before = server.metric(QUEUE_FULL), server.metric(Metric.DEMAND_RATIO)
            with ThreadPoolExecutor(CONNECTIONS - 4) as pool:  # within the connection cap
                answers = pool.map(lambda _: _post(server, STORM_ADDRESS), range(BURST + extra))
                wait_until(lambda: server.metric(QUEUE_FULL) >= refused + BURST + extra, 120, "every call decided")
                added = server.metric(Metric.DEMAND_RATIO) - before
                assert {status for status, _ in answers} == {429}
        assert backlog.result().count == 8
    one = INGEST_COST / Settings().demand_window_s / server.metric(Metric.CAPACITY)
    assert 0 < added <= (BURST + 1) * one * 1.001  # only decay lowers it between the reads


def _call_until(server: ServerProcess, stop: threading.Event) -> None:
    """A client that calls again as soon as it hears its answer, reconnecting when its connection
    is closed for room."""
    while not stop.is_set():
        connection = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=120)
        try:
            while not stop.is_set():
                connection.request("POST", "/v1/embeddings", INGEST_BODY, {"Content-Type": "application/json"})
                connection.getresponse().read()
        except (ConnectionError, http.client.HTTPException):
            pass
        finally:
            connection.close()


def _post(
    server: ServerProcess, source: str, path: str = "/v1/embeddings", body: bytes = INGEST_BODY
) -> tuple[int, dict[str, str]]:
    """An ingest posted from ``source`` on a new connection: its status and headers."""
    connection = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=120, source_address=(source, 0))
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status, dict(response.getheaders())
    finally:
        connection.close()
