"""Clients that try to stall, starve or outgrow a front end, on real servers with one front end:
bodies of millions of items, slow and idle connections, more sockets than descriptors, requests
that do not fit the memory budget, malformed requests, clients that leave. Each is refused or cut
off with the right code, in the edge's own shape, counted, and everyone else is still served."""

from __future__ import annotations

import json
import select
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from kembed.frontend.budget import frontend_budget, growth_bound
from kembed.frontend.connections import IDLE_GRACE_S
from kembed.frontend.process import TOKENIZER_THREADS
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.bodies import ONE_ANSWER
from tests.server.serving import ServerProcess, peer_ports, reset_peak_rss, rss_bytes, server_fixture, wait_until

pytestmark = pytest.mark.process

MAX_ITEMS = 64
BIG_MESSAGE = 16 * 1024 * 1024
TIMEOUT_MS = 3000  # a REST request's deadline from its head: short, so that slow bodies are cut off soon
HUGE_SEQUENCES = orjson.dumps({"input": [[0]] * 4_000_000})  # 16 MiB
HUGE_TEXTS = orjson.dumps({"input": ["a"] * 4_000_000})


server = server_fixture(
    frontends=1,
    admission="",
    max_items_per_request=MAX_ITEMS,
    max_message_bytes=BIG_MESSAGE,
    default_timeout_ms=TIMEOUT_MS,
    max_rest_connections=16,
)


def frontend(server: ServerProcess) -> int:
    return server.children()["frontend-0"]


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.rest_port), timeout=120)


def head(length: int | None = None, content_type: str = "application/json", extra: str = "") -> bytes:
    size = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    return f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n{size}\r\n{extra}\r\n".encode()


def answer(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the next answer on ``sock`` (read until its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _received(sock)
    top, rest = data.split(b"\r\n\r\n", 1)
    lines = top.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    while len(rest) < int(fields["Content-Length"]):
        rest += _received(sock)
    assert fields["Content-Type"].startswith("application/json"), fields
    return int(lines[0].split()[1]), json.loads(rest)


def _received(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise AssertionError("closed before an answer")
    return chunk


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (reads what it sent first)."""
    try:
        while chunk := sock.recv(65536):
            del chunk
    except ConnectionResetError:
        pass
    return True


def count(server: ServerProcess, code: str, api: str = "rest") -> float:
    return server.metric(f'kembed_requests_total{{api="{api}",code="{code}"}}')


def embedded(server: ServerProcess) -> bool:
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["still here"]), timeout=120).count == 1


@pytest.mark.parametrize("body", [HUGE_SEQUENCES, HUGE_TEXTS], ids=["4M sequences", "4M texts"])
def test_a_body_of_millions_of_items_is_refused_before_the_rest_of_it_is_sent(server: ServerProcess, body: bytes):
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body[: 256 * 1024])  # and never the rest
        status, error = answer(sock)
        assert (status, error["error"]["param"]) == (400, "input"), error
        assert error["error"]["message"] == f"input: more than {MAX_ITEMS} inputs, at most {MAX_ITEMS} per request"


def test_bodies_of_millions_of_items_sent_whole_leave_the_memory_flat(server: ServerProcess):
    pid = frontend(server)
    reset_peak_rss(pid)
    before, refused = rss_bytes(pid), count(server, "400")
    for body in (HUGE_SEQUENCES, HUGE_TEXTS) * 2:
        with connect(server) as sock:
            sock.sendall(head(len(body)) + body)
            assert answer(sock)[0] == 400
    # Parsed whole, each would have made millions of Python objects: 500 MB at 6e29202.
    assert rss_bytes(pid, "VmHWM") - before < 64 * 1024 * 1024
    assert count(server, "400") == refused + 4 and embedded(server)


def test_five_million_texts_over_grpc_are_refused_on_the_wire(server: ServerProcess):
    pid = frontend(server)
    request = pb.EmbedRequest(texts=["a"] * 5_000_000)  # 15 MB
    reset_peak_rss(pid)
    before, refused = rss_bytes(pid), count(server, "INVALID_ARGUMENT", "grpc")
    options = [("grpc.max_send_message_length", BIG_MESSAGE)]
    with grpc.insecure_channel(server.target, options=options) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.EmbedderStub(channel).Embed(request, timeout=120)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert str(caught.value.details()).startswith(f"texts: more than {MAX_ITEMS} texts")
    # Counted once sent: the client may hear it a moment before the count moves.
    wait_until(lambda: count(server, "INVALID_ARGUMENT", "grpc") == refused + 1, 60, "the refusal counted")
    # The message as received, twice (gRPC's buffer and its bytes); parsed, five million strings more.
    assert rss_bytes(pid, "VmHWM") - before < 3 * request.ByteSize()


def test_slow_bodies_are_cut_off_at_the_requests_deadline(server: ServerProcess):
    dribbled, chunked, stalled = connect(server), connect(server), connect(server)
    try:
        dribbled.sendall(head(1000) + b'{"input": ["a')
        chunked.sendall(head() + b'8\r\n{"input"\r\n')
        stalled.sendall(head(15_900_000) + b'{"input": ["' + b"a" * 1_000_000)
        for sock in (dribbled, chunked, stalled):  # each answered at its deadline, then closed
            status, error = answer(sock)
            assert (status, error["error"]["code"]) == (408, "request_timeout"), error
            assert closed(sock)
    finally:
        for sock in (dribbled, chunked, stalled):
            sock.close()
    assert embedded(server)


def test_past_the_connection_cap_the_oldest_idle_connection_is_closed(server: ServerProcess):
    idle = [connect(server) for _ in range(16)]
    try:
        time.sleep(IDLE_GRACE_S + 0.5)  # a connection is closed for being idle only once idle this long
        idle.append(connect(server))
        assert closed(idle[0])
        assert still_open(idle[1]) and still_open(idle[-1])  # not the idle timeout: only the oldest went
        with connect(server) as sock:  # a newcomer is served: another idle one made room
            sock.sendall(head(len(b'{"input": "x"}')) + b'{"input": "x"}')
            assert answer(sock)[0] == 200
        assert len(peer_ports(frontend(server), server.rest_port)) <= 16
    finally:
        for sock in idle:
            sock.close()


def test_past_the_connection_cap_the_client_holding_the_most_makes_room(server: ServerProcess):
    """One client holds every connection, none idle long enough to be closed for it: a neighbour's
    new connection is served all the same, and one of the holder's is closed for it."""
    held = [connect(server) for _ in range(16)]
    try:
        neighbour = socket.create_connection(("127.0.0.1", server.rest_port), 120, source_address=("127.0.0.2", 0))
        with neighbour:
            neighbour.sendall(head(len(b'{"input": "x"}')) + b'{"input": "x"}')
            assert answer(neighbour)[0] == 200
        assert sum(not still_open(sock) for sock in held) == 1
    finally:
        for sock in held:
            sock.close()


def test_past_the_connection_cap_a_newcomer_tied_with_idle_clients_is_served(server: ServerProcess):
    """Sixteen clients (addresses) hold one idle connection each: every newcomer ties with them at
    one, and the tie closes an idle one, never the newcomer's own (which was closed, 5 of 5, when a
    tie made room from the newcomer's client)."""
    idle = [
        socket.create_connection(("127.0.0.1", server.rest_port), 120, source_address=(f"127.0.0.{10 + i}", 0))
        for i in range(16)
    ]
    newcomers: list[socket.socket] = []
    try:
        time.sleep(IDLE_GRACE_S + 0.5)  # idle long enough to be closed for room
        for i in range(5):  # each kept open: room is made for each
            address = (f"127.0.0.{2 + i}", 0)
            newcomers.append(socket.create_connection(("127.0.0.1", server.rest_port), 120, source_address=address))
            newcomers[-1].sendall(head(len(b'{"input": "x"}')) + b'{"input": "x"}')
            assert answer(newcomers[-1])[0] == 200
        assert sum(not still_open(sock) for sock in idle) == 5
    finally:
        for sock in idle + newcomers:
            sock.close()


def still_open(sock: socket.socket) -> bool:
    """Not closed by the server: nothing to read on it, not even its end."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


MALFORMED = {
    "a bad header": (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    "method not allowed": (b"GET /v1/embeddings HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    "no such route": (b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "text/plain": (head(14, "text/plain") + b'{"input": "x"}', 415),
    "no content type": (head(14, "") + b'{"input": "x"}', 415),
    "compressed": (head(14, extra="Content-Encoding: gzip\r\n") + b'{"input": "x"}', 415),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_what_aiohttp_or_the_edge_refuses_is_in_openai_shape_and_counted(server: ServerProcess, case: str):
    request, status = MALFORMED[case]
    before = count(server, str(status))
    with connect(server) as sock:
        sock.sendall(request)
        got, body = answer(sock)
    assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, body
    wait_until(lambda: count(server, str(status)) == before + 1, 60, f"the {status} counted")
    assert "Traceback" not in server.output()


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize("case", ONE_ANSWER)
def test_a_body_gets_one_answer_however_tcp_cuts_it(server: ServerProcess, case: str):
    """Sent with its head in one write, and after its head has been read (the server's 100 Continue),
    so parsed whole or as it arrives: the same status and body (vectors within float noise)."""
    body, status, param = ONE_ANSWER[case]
    with connect(server) as sock:
        sock.sendall(head(len(body)) + body)
        whole = answer(sock)
    with connect(server) as sock:
        sock.sendall(head(len(body), extra="Expect: 100-continue\r\n"))
        interim = b""
        while len(interim) < len(CONTINUE) and (more := sock.recv(len(CONTINUE) - len(interim))):
            interim += more  # and no further: an empty body's answer may follow at once
        assert interim == CONTINUE
        sock.sendall(body)
        streamed = answer(sock)
    assert whole[0] == status and whole[1].get("error", {}).get("param") == param, whole
    if status == 200:
        vectors = [np.asarray([item.pop("embedding") for item in got["data"]]) for _, got in (whole, streamed)]
        np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-5)
    assert streamed == whole
    assert "Traceback" not in server.output()


def test_rest_connections_leave_descriptors_for_grpc(tmp_path: Path):
    nofile = 300  # as `ulimit -n 300`
    server = ServerProcess(tmp_path / "server.log", nofile=nofile, frontends=1, admission="").wait_ready()
    idle: list[socket.socket] = []
    try:
        idle += [connect(server) for _ in range(290)]
        assert embedded(server)  # at 6e29202: DEADLINE_EXCEEDED, "Too many open files" in the log
        assert len(peer_ports(frontend(server), server.rest_port)) < nofile // 2
        assert "Too many open files" not in server.output()
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_draining_does_not_wait_for_a_body_still_arriving(tmp_path: Path):
    server = ServerProcess(tmp_path / "server.log", frontends=1, drain_timeout_s=600).wait_ready()
    try:
        with connect(server) as sock:
            sock.sendall(head(1000) + b'{"input": ["a')  # the rest never comes
            wait_until(lambda: len(peer_ports(frontend(server), server.rest_port)) == 1, 60, "the body being read")
            server.process.send_signal(signal.SIGTERM)
            status, error = answer(sock)
            assert (status, error["error"]["code"]) == (503, "unavailable")
        assert server.process.wait(timeout=120) == 0  # at 6e29202 it waited the whole 600 s
    finally:
        server.stop()


def test_a_client_that_leaves_has_its_call_dropped_and_one_log_line(tmp_path: Path):
    server = ServerProcess(tmp_path / "server.log", held=True, frontends=1, admission="").wait_ready()
    try:
        body = orjson.dumps({"input": ["computed for nobody"] * 4})
        ok = count(server, "200")
        with grpc.insecure_channel(server.target) as channel:
            with server.engine:
                blocker = pb_grpc.EmbedderStub(channel).Embed.future(pb.EmbedRequest(texts=["first"]), timeout=120)
                server.wait_open_requests(1)  # its batch waits in the model: the next calls queue behind it
                leaving = [connect(server) for _ in range(3)]
                for sock in leaving:
                    sock.sendall(head(len(body)) + body)
                server.wait_open_requests(4)
                for sock in leaving:
                    sock.close()
                server.wait_open_requests(1)  # the engine dropped the three before computing them
                with connect(server) as mid_body:
                    mid_body.sendall(head(1000) + body[:10])
                wait_until(lambda: "left while sending its request" in server.output(), 60, "the disconnect logged")
            assert blocker.result().count == 1
        assert count(server, "200") == ok
        assert server.output().count("left before its answer") == 3 and "Traceback" not in server.output()
        assert server.metric('kembed_calls_gone_total{api="rest"}') == 4
    finally:
        server.stop()


def test_many_maximal_requests_at_once_stay_within_the_memory_bound(tmp_path: Path):
    message, memory = 1024 * 1024, 256 * 1024 * 1024
    budget = frontend_budget(memory, 1, message)
    server = ServerProcess(
        tmp_path / "server.log",
        held=True,
        frontends=1,
        admission="",
        memory_limit_bytes=memory,
        max_message_bytes=message,
        max_text_chars=70_000,
    ).wait_ready()
    texts = ["word " * 13_000] * 15  # 975,000 characters: a maximal request
    rest_body = orjson.dumps({"input": texts, "truncate": True})
    grpc_request = pb.EmbedRequest(texts=texts, truncate=True)
    assert len(rest_body) < message and grpc_request.ByteSize() < message
    pid = frontend(server)
    try:
        reset_peak_rss(pid)
        before = rss_bytes(pid)
        with ThreadPoolExecutor(128) as pool, grpc.insecure_channel(server.target) as channel, server.engine:
            stub = pb_grpc.EmbedderStub(channel)
            by_rest = [pool.submit(_post, server, rest_body) for _ in range(64)]
            by_grpc = [stub.Embed.future(grpc_request, timeout=300) for _ in range(64)]
            decided = lambda: sum(f.done() for f in by_rest + by_grpc) + server.health()["open_requests"] == 128  # noqa: E731
            wait_until(decided, 300, "every call refused or admitted")
            peak = rss_bytes(pid, "VmHWM") - before
            refused = [f.result() for f in by_rest if f.done()]
            assert refused and all(status == 429 and headers["Retry-After"] for status, headers in refused)
            assert any(f.done() and f.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for f in by_grpc)
        assert peak <= growth_bound(budget, message, TOKENIZER_THREADS), (peak, budget)
    finally:
        server.stop()


def _post(server: ServerProcess, body: bytes) -> tuple[int, dict[str, str]]:
    with socket.create_connection(("127.0.0.1", server.rest_port), timeout=300) as sock:
        sock.sendall(head(len(body)) + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += _received(sock)
        lines = data.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
        return int(lines[0].split()[1]), dict(line.split(": ", 1) for line in lines[1:])
