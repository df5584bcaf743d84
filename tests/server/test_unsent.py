"""What a client holds without sending (issue 57), on a real server with one front end, 8 gRPC call
slots and a 48 MiB memory budget: calls that send their head and never their message do not keep
another client's calls from a slot, REST heads declaring a large body hold none of the budget, and
bodies that stall hold at most their client's share of it. The bystander is on its own connection
(gRPC) or address (REST), and is served."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import grpc
import pytest

from kembed.contract import GRPC_SERVICE
from kembed.frontend.budget import BODY_SHARE, BODY_WEIGHT, frontend_budget
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, wait_until
from tests.server.test_hostile_clients import CONTINUE, answer, head

pytestmark = pytest.mark.process

SLOTS = 8
MESSAGE = 1024 * 1024
MEMORY = 192 * 1024 * 1024
BUDGET = frontend_budget(MEMORY, 1, MESSAGE)  # 48 MiB
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # channels otherwise share one connection
BYSTANDER = "127.0.0.2"  # loopback too, but another REST client than 127.0.0.1
ONE_TEXT = b'{"input": "still served"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("unsent") / "server.log"
    running = ServerProcess(
        log,
        frontends=1,
        admission="",
        max_concurrent_rpcs=SLOTS,
        memory_limit_bytes=MEMORY,
        max_message_bytes=MESSAGE,
    )
    yield running.wait_ready()
    running.stop()


class Silent:
    """Embed calls that send their head and never their message, on one channel (one connection);
    with ``reopen``, each call cut is opened again at once, as an attacker would."""

    def __init__(self, target: str, calls: int, reopen: bool = False) -> None:
        self._channel = grpc.insecure_channel(target, options=OWN_CONNECTION)
        self._embed = self._channel.stream_unary(
            f"/{GRPC_SERVICE}/Embed",
            request_serializer=pb.EmbedRequest.SerializeToString,
            response_deserializer=pb.EmbedResponse.FromString,
        )
        self._stop = threading.Event()
        self._reopen = reopen
        self.ended: list[grpc.Future] = []
        self._calls = [self._open() for _ in range(calls)]

    def _nothing(self) -> Iterator[pb.EmbedRequest]:
        self._stop.wait()
        yield from ()

    def _open(self) -> grpc.Future:
        call = self._embed.future(self._nothing(), timeout=300)
        call.add_done_callback(self._cut)
        return call

    def _cut(self, call: grpc.Future) -> None:
        self.ended.append(call)
        if self._reopen and not self._stop.is_set() and "no message arrived" in refusal(call)[1]:
            self._calls.append(self._open())

    def close(self) -> None:
        self._stop.set()
        for call in list(self._calls):
            call.cancel()
        self._channel.close()


def bystander_calls(server: ServerProcess, calls: int) -> list[grpc.StatusCode]:
    with grpc.insecure_channel(server.target, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        codes = []
        for _ in range(calls):
            try:
                stub.Embed(pb.EmbedRequest(texts=["a bystander"]), timeout=120)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
        return codes


def test_calls_without_a_message_on_one_connection_leave_a_bystander_served(server: ServerProcess) -> None:
    """Every slot is held by calls that sent only their head (the bystander got 8 of 8 refused,
    "this server handles 8 calls at once"): the bystander's first call takes a slot back, and the
    silent call that held it is refused."""
    silent = Silent(server.target, SLOTS + 4)  # more than the slots: the rest are refused at once
    try:
        wait_until(lambda: len(silent.ended) >= 4, 60, "the calls past the slots refused")
        assert bystander_calls(server, SLOTS) == [grpc.StatusCode.OK] * SLOTS
        wait_until(lambda: len(silent.ended) >= 5, 60, "a silent call taken back")
        taken_back = [refusal(call) for call in silent.ended if "no message arrived" in refusal(call)[1]]
        assert taken_back and {code for code, _ in taken_back} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        silent.close()


def refusal(call: grpc.Future) -> tuple[grpc.StatusCode | None, str]:
    error = call.exception()
    return (error.code(), str(error.details())) if isinstance(error, grpc.Call) else (None, "")


def test_calls_without_a_message_reopened_on_many_connections_leave_a_bystander_served(
    server: ServerProcess,
) -> None:
    """Each silent call cut is opened again at once, from eight connections: every slot stays held
    by one (the bystander got 119 of 119 refused on the operator's default pod)."""
    silent = [Silent(server.target, 2, reopen=True) for _ in range(SLOTS)]  # two a connection: more than the slots
    try:
        wait_until(lambda: sum(len(attacker.ended) for attacker in silent) >= SLOTS, 60, "the slots full")
        assert bystander_calls(server, 2 * SLOTS) == [grpc.StatusCode.OK] * (2 * SLOTS)
    finally:
        for attacker in silent:
            attacker.close()


def test_streams_that_send_nothing_leave_a_bystander_served(server: ServerProcess) -> None:
    """A stream waits for a message whenever none of its requests is in flight: one that sent a
    request and stopped, or never sent one, gives its slot back for a call that has a message."""
    stop = threading.Event()

    def one_then_nothing(first: bool) -> Iterator[pb.EmbedRequest]:
        if first:
            yield pb.EmbedRequest(texts=["one"])
        stop.wait()

    with grpc.insecure_channel(server.target, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        streams = [stub.EmbedStream(one_then_nothing(True), timeout=300) for _ in range(SLOTS // 2)]
        assert [next(stream).count for stream in streams] == [1] * len(streams)  # answered: idle now
        streams += [stub.EmbedStream(one_then_nothing(False), timeout=300) for _ in range(SLOTS // 2 + 2)]
        try:
            wait_until(lambda: sum(stream.done() for stream in streams) >= 2, 60, "the streams past the slots refused")
            assert bystander_calls(server, SLOTS) == [grpc.StatusCode.OK] * SLOTS
        finally:
            stop.set()  # the streams not taken back end now
        ends = [stream_end(stream) for stream in streams]
    assert (grpc.StatusCode.RESOURCE_EXHAUSTED, True) in ends, ends
    assert {code for code, _ in ends} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def stream_end(stream: Iterator[pb.EmbedResponse]) -> tuple[grpc.StatusCode, bool]:
    """How a stream ended: its code, and whether it was taken back for sending nothing."""
    try:
        list(stream)
    except grpc.RpcError as error:
        return error.code(), "no message arrived" in str(error.details())
    return grpc.StatusCode.OK, False


def rest_call(server: ServerProcess, source: str = BYSTANDER) -> int:
    with socket.create_connection(("127.0.0.1", server.rest_port), 120, source_address=(source, 0)) as sock:
        sock.sendall(head(len(ONE_TEXT)) + ONE_TEXT)
        return answer(sock)[0]


def count_429(server: ServerProcess) -> float:
    return server.metric('kembed_requests_total{api="rest",code="429"}')


def test_heads_without_their_bodies_hold_none_of_the_budget(server: ServerProcess) -> None:
    """More heads declaring the largest body than the budget holds twice over (each was weighed at
    twice its Content-Length before a byte arrived: the bystander got 429 and RESOURCE_EXHAUSTED)."""
    heads = [socket.create_connection(("127.0.0.1", server.rest_port), 120) for _ in range(BUDGET // MESSAGE)]
    try:
        for sock in heads:  # each read and weighed when the server says its body is welcome
            sock.sendall(head(MESSAGE, extra="Expect: 100-continue\r\n"))
        assert [sock.recv(len(CONTINUE)) for sock in heads] == [CONTINUE] * len(heads)
        assert rest_call(server) == 200
        assert bystander_calls(server, 2) == [grpc.StatusCode.OK] * 2
    finally:
        for sock in heads:
            sock.close()


def test_bodies_that_stall_hold_at_most_their_clients_share(server: ServerProcess) -> None:
    """One client sends most of the largest body on more connections than the budget holds, and
    stalls: past its share (a quarter of the budget) each is refused 429 at the chunk that does not
    fit, and a client on another address is served."""
    sent = MESSAGE * 9 // 10
    within_share = BUDGET // BODY_SHARE // (BODY_WEIGHT * sent)
    stalled = [socket.create_connection(("127.0.0.1", server.rest_port), 120) for _ in range(BUDGET // sent)]
    before = count_429(server)
    try:
        for sock in stalled:
            sock.sendall(head(MESSAGE) + b'{"input": ["' + b"a" * (sent - 12))
        refused = len(stalled) - within_share
        wait_until(lambda: count_429(server) >= before + refused, 120, "the bodies past the share refused")
        assert count_429(server) == before + refused
        assert rest_call(server) == 200
        assert bystander_calls(server, 2) == [grpc.StatusCode.OK] * 2
    finally:
        for sock in stalled:
            sock.close()
