"""Admission that one client cannot game, end to end: each way a careless or hostile client defeated
it (issue 25), reproduced against a real server whose engine is held (nothing computes until the
checks are done), so what is asserted is codes and counts, never how long anything took.

The server's batches are up to 8,192 padded tokens (32 rows of 256): at any rate a CPU reaches, one
batch of ingest in the worker is over the 2 s drain budget twice over, as a 2,048-token batch was at
a busy node's 1,850 tokens/s.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from kembed.config.settings import Settings
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, server_fixture, wait_until

pytestmark = pytest.mark.process

OK, EXHAUSTED, INVALID = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT
PASSAGE = "word " * 200  # 202 tokens: the 256 bucket
QUERY = pb.EmbedRequest(texts=["kubernetes"])  # 3 tokens: the 16 bucket
WAIT_S = 300
REFUSAL_BURST = 20  # a client's refusals answered at once; past them, paced
PACED = "kembed_refusals_paced_total"
T = TypeVar("T")
Call = Any  # a call's future: code(), details() (the stubs type it as Any)


server = server_fixture(
    held=True,
    frontends=1,
    max_batch_size=32,
    max_tokens_per_batch=8192,
    refusal_burst=REFUSAL_BURST,
    refusal_rate=1,
    # A request that sets no deadline gets at least this: what the tests hold here is the order
    # of service, not the default deadline, which a CI machine's load can spend while the
    # engine is held (the LangChain-like ingest was answered 504 there).
    default_timeout_ms=600_000,
)


@pytest.fixture
def stub(server: ServerProcess) -> Iterator[pb_grpc.EmbedderStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.EmbedderStub(channel)


@pytest.fixture
def other_client(server: ServerProcess) -> Iterator[pb_grpc.EmbedderStub]:
    """A client of its own: a connection of its own."""
    with grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        yield pb_grpc.EmbedderStub(channel)


def decided(
    server: ServerProcess, send: Callable[[], T], done: Callable[[T], bool], also: Callable[[], bool] = bool
) -> T:
    """Send one call and wait until it is refused (done) or admitted into the held engine (or ``also``)."""
    admitted = server.health()["open_requests"]
    call = send()
    wait_until(lambda: done(call) or also() or server.health()["open_requests"] > admitted, 120, "a decision")
    return call


def is_done(call: Any) -> bool:
    return bool(call.done())


def queries(server: ServerProcess, stub: pb_grpc.EmbedderStub, count: int) -> list[grpc.Future]:
    """``count`` one-text queries, one at a time, each decided before the next."""
    return [decided(server, lambda: stub.Embed.future(QUERY, timeout=WAIT_S), is_done) for _ in range(count)]


def refusals(server: ServerProcess, priority: str = "interactive") -> float:
    """The class's rejections by admission, for any reason."""
    return sum(
        server.metric(f'kembed_rejected_total{{priority="{priority}",reason="{reason}"}}')
        for reason in ("drain_time", "latency_shed", "latency_hard", "queue_full", "displaced")
    )


def test_one_maximal_request_does_not_shut_queries_out(
    server: ServerProcess, stub: pb_grpc.EmbedderStub, other_client: pb_grpc.EmbedderStub
):
    """1,024 passages sent interactive (262,144 padded tokens, the queue cap): served as batch work,
    its first batch in the worker. Twelve queries from another client are all admitted: a query is
    weighed against interactive work alone, whatever the rate and the ingest's batches."""
    demoted, refused = server.metric("kembed_demoted_total"), refusals(server)
    with server.engine:
        big = stub.Embed.future(pb.EmbedRequest(texts=[PASSAGE] * 1024), timeout=WAIT_S)
        server.wait_open_requests(1)
        assert server.metric("kembed_demoted_total") == demoted + 1
        started = lambda: server.health()["waiting_requests"] == {"interactive": 0, "batch": 0}  # noqa: E731
        wait_until(started, 120, "its first batch in the worker")  # held there
        sent = queries(server, other_client, 12)
        assert not any(q.done() for q in sent) and server.health()["open_requests"] == 13
        assert server.health()["waiting_requests"]["interactive"] == 12
    assert {q.result(timeout=WAIT_S).count for q in sent} == {1}  # computed before the rest of the ingest
    assert refusals(server) == refused
    big.cancel()
    # The next test finds the server as a new client would: the cancelled ingest's batch done, and
    # the queries held here out of the latency window (their p95, as long as a loaded machine made
    # the hold, may shed new batch work meanwhile).
    wait_until(lambda: window_without_queries(server), 120, "the server idle, the held queries out of its p95")


def window_without_queries(server: ServerProcess) -> bool:
    """Whether no query was served over one latency window from now (it waits the window out)."""
    served = 'kembed_request_duration_seconds_count{priority="interactive"}'
    before = server.metric(served)
    time.sleep(Settings().latency_window_s + 1)
    return server.metric(served) == before and settled(server)


def settled(server: ServerProcess) -> bool:
    health = server.health()
    return health["open_requests"] == 0 and health["worker_queue_depth"] == 0 and health["status"] == "healthy"


def test_an_ingest_sent_like_langchain_is_served_and_does_not_shut_queries_out(
    server: ServerProcess, other_client: pb_grpc.EmbedderStub
):
    """The same over the OpenAI API, as LangChain's OpenAIEmbeddings sends it: many texts, no
    priority, no deadline. It goes as batch work, queries pass it, and it is answered: a request
    without a deadline gets time for its own work at the measured rate."""
    demoted, refused = server.metric("kembed_demoted_total"), refusals(server)
    body = {"input": [PASSAGE] * 64, "model": "sentence-transformers/all-MiniLM-L6-v2"}  # 16,384 padded tokens
    with ThreadPoolExecutor(1) as pool:
        with server.engine:
            ingest: Future[tuple[int, Any]] = pool.submit(post, server, body)
            wait_until(lambda: ingest.done() or server.health()["open_requests"] == 1, 120, "the ingest admitted")
            assert not ingest.done(), f"the ingest was answered while the engine was held: {ingest.result()}"
            assert server.metric("kembed_demoted_total") == demoted + 1
            sent = queries(server, other_client, 12)
            assert server.health()["open_requests"] == 13
        status, answer = ingest.result(timeout=WAIT_S)
    assert status == 200 and len(answer["data"]) == 64
    assert {q.result(timeout=WAIT_S).count for q in sent} == {1}
    assert refusals(server) == refused


def test_refused_maximal_requests_do_not_move_the_p95_or_health(server: ServerProcess, stub: pb_grpc.EmbedderStub):
    """While a 4,096-token request is in the worker, six pre-tokenized requests of 1,024 x 256 ids
    are refused. The exported P95 (the autoscaler's) and /health count served requests alone:
    nothing was served, so they stay at nothing, and /health is not ``overloaded``.

    Each comes from a client of its own: a refusal weighs its bytes in its client's refusal pacing
    (1 MB is past this server's burst of 20), so on one connection each next answer waited 10 s."""
    ids = np.full(256, 2088, dtype="<i4").tobytes() * 1024
    maximal = pb.EmbedRequest(tokens=pb.TokenIds(ids=ids, lengths=[256] * 1024))
    p95 = "kembed_request_latency_p95_seconds"
    forgotten = lambda: server.metric(p95) == 0 and settled(server)  # noqa: E731
    wait_until(forgotten, 120, "the latency window to forget the last test's queries, and shedding to stop")
    # A P95 of 0 also means fewer than its fewest samples, and one more would bring the last test's
    # back: wait for a whole window with no query served, so that it holds none.
    wait_until(lambda: window_without_queries(server), 120, "a latency window with no query in it")
    refused_before = refusals(server, "batch")
    with contextlib.ExitStack() as clients, server.engine:

        def a_clients_own() -> Call:
            options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
            channel = clients.enter_context(grpc.insecure_channel(server.target, options=options))
            return pb_grpc.EmbedderStub(channel).Embed.future(maximal, timeout=WAIT_S)

        running = decided(
            server, lambda: stub.Embed.future(pb.EmbedRequest(texts=[PASSAGE] * 16), timeout=WAIT_S), is_done
        )
        assert not running.done(), f"the first request was refused: {running.code()} {running.details()}"
        refused = [decided(server, a_clients_own, is_done) for _ in range(6)]
        assert sum(call.done() and call.code() == EXHAUSTED for call in refused) >= 5
        assert refusals(server, "batch") >= refused_before + 5  # the queue cap, or the drain budget
        health = server.health()
        assert health["p95_server_side_latency_ms"] == 0 and health["status"] != "overloaded"
        assert server.metric(p95) == 0
    for call in refused:
        call.cancel()
    assert running.result(timeout=WAIT_S).count == 16


def test_a_text_of_one_word_and_a_hundred_thousand_tokens_is_refused(stub: pb_grpc.EmbedderStub):
    """``"a." * 49999`` is one whitespace word and 100,000 WordPiece tokens; ten of them (1 MB) are
    refused naming the first, after tokenizing a prefix of each (the work is bounded in
    tests/server/test_inputs.py)."""
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=["a." * 49_999] * 10), timeout=WAIT_S)
    assert refused.value.code() == INVALID
    assert (refused.value.details() or "").startswith("texts[0]: over the model's 256 tokens")


def test_a_rest_client_cannot_evade_its_pacing_with_new_connections(server: ServerProcess):
    """Each call on a new connection, from one address: past the address's refusal burst, its
    refusals are answered at its refusal rate, whichever connection they come on."""
    body = {"input": [PASSAGE] * 4}
    paced = server.metric(PACED)
    with ThreadPoolExecutor(64) as pool, server.engine:
        calls: list[Future[tuple[int, Any]]] = []
        while server.metric(PACED) == paced:  # a new connection a call (urllib opens one each time)
            calls.append(decided(server, lambda: pool.submit(post, server, body), is_done))
            assert len(calls) < 4 * REFUSAL_BURST, "no refusal was ever paced"
        assert sum(call.done() and call.result()[0] == 429 for call in calls) > REFUSAL_BURST
    assert {call.result(timeout=WAIT_S)[0] for call in calls} <= {200, 429}


def test_expired_work_stops_counting_against_new_requests(server: ServerProcess, stub: pb_grpc.EmbedderStub):
    """Queries with a 4 s deadline fill the interactive budget until one is refused; once their
    deadlines pass, with the engine still held, the queue holds none of them and a query is
    admitted."""
    with server.engine:
        server.wait_open_requests(0)
        short = pb.EmbedRequest(texts=[PASSAGE])
        sent: list[Call] = []
        while not (sent and sent[-1].done()):
            sent.append(decided(server, lambda: stub.Embed.future(short, timeout=4), is_done))
        assert sent[-1].code() == EXHAUSTED and len(sent) > 1
        wait_until(lambda: all(call.done() for call in sent), 120, "their deadlines")
        wait_until(lambda: server.health()["waiting_requests"]["interactive"] == 0, 120, "the queue forgets them")
        query = decided(server, lambda: stub.Embed.future(QUERY, timeout=WAIT_S), is_done)
        assert not query.done()  # admitted
    assert query.result(timeout=WAIT_S).count == 1
    assert {call.code() for call in sent[:-1]} == {grpc.StatusCode.DEADLINE_EXCEEDED}


def post(server: ServerProcess, body: dict[str, Any]) -> tuple[int, Any]:
    """Status and JSON body of one POST /v1/embeddings, on a connection of its own."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        server.rest_url + "/embeddings", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
