"""Connection age (docs/decisions/connection-age.md): a client that holds its connections, gRPC's
channel or the openai SDK's keep-alive pool, reaches a replica added beside the one it is connected
to once its connection has aged, through a Service that balances per connection as a ClusterIP does;
and it sees no error across the age, a call in flight on an aged connection included."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kembed.client import EmbedClient
from tests.server.serving import ServerProcess, wait_until

AGE_MS = 3000  # each connection closes within 2.7 to 3.3 s: a first answer comes well within it
OLDEST_S = AGE_MS * 1.1 / 1000 + 0.3  # the latest an age can end, whatever its jitter drew, and a timer's slack
ALIAS = "minilm"
GRPC_OK = 'kembed_requests_total{api="grpc",code="OK"}'
REST_OK = 'kembed_requests_total{api="rest",code="200"}'

pytestmark = pytest.mark.process


class Service:
    """A ClusterIP Service as kube-proxy's IPVS mode holds it (round robin): each connection goes to
    the next backend port when it is accepted, and stays there for its whole life."""

    def __init__(self, backend: int) -> None:
        self.backends = [backend]
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._turn = itertools.count()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            self.accepted += 1
            backend = self.backends[next(self._turn) % len(self.backends)]
            upstream = socket.create_connection(("127.0.0.1", backend))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._listener.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Bytes one way until either side ends; then both sockets are shut, as a closed conntrack entry."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for end in (source, sink):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)


def _server(folder: Path, name: str) -> ServerProcess:
    return ServerProcess(
        folder / f"{name}.log",
        held=True,
        frontends=1,
        admission="",
        served_model_name=ALIAS,
        max_connection_age_ms=AGE_MS,
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    folder = tmp_path_factory.mktemp("connection-age")
    first, added = _server(folder, "first"), _server(folder, "added")  # both load at once
    yield first.wait_ready(), added.wait_ready()
    first.stop()
    added.stop()


def _calls_reach_the_added_replica(call: Callable[[], object], service: Service, added: ServerProcess, ok: str) -> None:
    """Calls on one client, every one answered, until its connection has aged and it connected again
    by itself (on the first replica alone: REST closes at the first answer past the age), then until
    the replica added to the Service answers some."""

    def answered_until(done: Callable[[], bool]) -> Callable[[], bool]:
        def step() -> bool:
            call()
            time.sleep(0.1)
            return done()

        return step

    wait_until(answered_until(lambda: service.accepted >= 2), 120, "the client connecting again")
    before = added.metric(ok)
    service.backends.append(added.rest_port if ok == REST_OK else added.grpc_port)
    wait_until(answered_until(lambda: added.metric(ok) > before), 120, "a call answered by the replica added")


def _past_age(connected: float) -> None:
    """Until a connection made at ``connected`` (monotonic) is past its age: the state waited for is
    the connection's age, which only time brings."""
    time.sleep(max(0.0, connected + OLDEST_S - time.monotonic()))


def test_a_grpc_client_reaches_a_replica_added_once_its_connection_ages(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    first, added = servers
    service = Service(first.grpc_port)
    client = EmbedClient(f"127.0.0.1:{service.port}")
    try:
        _calls_reach_the_added_replica(lambda: client.embed(["hello world"]), service, added, GRPC_OK)
        assert client.retries == 0  # GOAWAY cost no call an error, not even one retried
    finally:
        client.close()
        service.close()


def test_an_openai_client_reaches_a_replica_added_once_its_connection_ages(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    first, added = servers
    service = Service(first.rest_port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{service.port}/v1", api_key="unused", max_retries=0)
    try:
        _calls_reach_the_added_replica(
            lambda: client.embeddings.create(model=ALIAS, input=["hello world"]), service, added, REST_OK
        )
    finally:
        client.close()
        service.close()


def test_a_call_in_flight_on_an_aged_grpc_connection_is_answered(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    first, _ = servers
    client = EmbedClient(first.target)
    try:
        with ThreadPoolExecutor(1) as pool, first.engine:
            connected = time.monotonic()  # at the latest: the call below connects
            held = pool.submit(client.embed, ["hello world"])
            first.wait_open_requests(1)
            _past_age(connected)  # GOAWAY sent; the call has the drain timeout's grace
            first.engine.release()
            assert len(held.result(timeout=120)) == 1
        assert len(client.embed(["on a new connection"])) == 1
        assert client.retries == 0
    finally:
        client.close()


def test_a_rest_answer_past_the_age_closes_its_connection(servers: tuple[ServerProcess, ServerProcess]) -> None:
    first, _ = servers
    connection = http.client.HTTPConnection("127.0.0.1", first.rest_port, timeout=120)
    body = b'{"model": "minilm", "input": ["hello world"]}'
    headers = {"Content-Type": "application/json"}
    try:
        connected = time.monotonic()  # at the latest: the request below connects
        connection.request("POST", "/v1/embeddings", body, headers)
        young = connection.getresponse()
        young.read()
        assert young.status == 200 and young.getheader("Connection") != "close"
        with first.engine:  # the request arrives young, and is answered past the age
            connection.request("POST", "/v1/embeddings", body, headers)
            first.wait_open_requests(1)
            _past_age(connected)
        aged = connection.getresponse()
        aged.read()
        assert aged.status == 200 and aged.getheader("Connection") == "close"
        assert aged.will_close
    finally:
        connection.close()
