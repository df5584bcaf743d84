"""What the whole suite shares: its guards, and the session's plain server.

The guards: the ``process`` mark and the lanes it makes (tests/lanes.py), and the server's default
ports, held while the suite runs. A test server started without one of its ports would bind the
default (gRPC 50051, REST 8080, health 8001), and race whatever else serves there: another
checkout's suite, a developer's server. Held here, such a server fails at once, naming the port
("gRPC port 127.0.0.1:50051: Address already in use"). Test servers bind port 0 and read the ports
they got off their first line (``tests/server/serving.py``)."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator

import pytest

from kembed.contract import GRPC_PORT, HTTP_PORT, REST_PORT
from tests.server.serving import HELD, PLAIN, ServerProcess, server_fixture

# tests/lanes.py: the `process` mark and its guard; pytester: the guard's own tests run pytest in pytest.
pytest_plugins = ("tests.lanes", "pytester")

DEFAULT_PORTS = (GRPC_PORT, REST_PORT, HTTP_PORT)

# Servers for the session (tests/server/serving.py): the plain one, shared by the modules whose
# tests differ only in per-call options (the_plain_server()), and the held one (held_server).
plain_server = server_fixture(scope="session", **PLAIN)
session_held_server = server_fixture(held=True, scope="session", **HELD)


@pytest.fixture
def held_server(session_held_server: ServerProcess) -> Iterator[ServerProcess]:
    """The session's held server, released after each test (one that failed holding it included)."""
    yield session_held_server
    session_held_server.engine.release()
    session_held_server.wait_open_requests(0)


@pytest.fixture(scope="session", autouse=True)
def default_ports_held() -> Iterator[list[int]]:
    """The default ports this session holds (one taken already is held by its taker, as well)."""
    with contextlib.ExitStack() as held:
        ports = []
        for port in DEFAULT_PORTS:
            with contextlib.suppress(OSError):
                held.enter_context(hold(port))
                ports.append(port)
        yield ports


def hold(port: int) -> socket.socket:
    """``port`` on every address of both families, bound without SO_REUSEADDR or SO_REUSEPORT and
    not listening: no other socket can bind it, and a connection to it is refused at once."""
    try:
        return _bound(socket.AF_INET6, "::", port)
    except OSError as error:
        if error.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):  # IPv6 is there: the port is taken
            raise
        return _bound(socket.AF_INET, "0.0.0.0", port)


def _bound(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    with contextlib.ExitStack() as on_error:
        sock = on_error.enter_context(socket.socket(family))
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        on_error.pop_all()  # bound: the caller's to close
    return sock
