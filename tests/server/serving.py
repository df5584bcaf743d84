"""A real kembed server for tests: ``python -m kembed`` (the supervisor, its engine and its front
ends) on loopback ports the kernel picks (port 0, read off the server's first line: a port found
free first is a race another process may win), with small buckets so warmup takes seconds.

A module's server is one line, ``server = server_fixture(frontends=1, admission="")``: a fixture
started once for the module (or the session, ``scope="session"``) and stopped after it, whatever
its tests did. A test that starts and stops its own uses ``with serving(tmp_path, ...) as server``.
A module whose tests differ from a plain server's only in per-call options shares the session's
instead of starting its own, ``server = the_plain_server()`` (its settings: ``PLAIN``); a test
that needs the engine held asks for ``held_server`` (``HELD``): a start costs 7 s on an idle
2-core machine and more beside load. A test on a shared server leaves it as it found it (nothing
held, nothing queued) and reads its metrics and its log as differences. A test that uses
a server is marked ``process`` (tests/lanes.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import grpc
import pytest

from kembed.contract import env_name
from kembed.plumbing import listen
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.held import HOLD_ENV, EngineHold

FAST = {
    "buckets": "16,32,64,128,256",
    "max_batch_size": 16,
    "max_tokens_per_batch": 2048,
    # What tests compare against is fp32 (sentence-transformers, vectors of one text in different
    # batches); auto would measure and may serve bf16 on a CPU with bf16 units (tests/server/test_cpu.py).
    "dtype": "float32",
    # Auto compiles the forward on a CPU (kembed.engine.cpu_compile): a minute of warmup on two busy
    # cores, in every test server. Eager unless a test asks for compiled (tests/server/test_cpu_compile.py).
    "compile": "off",
    # A test's channel is one client on one connection (its front end, its refusal pacing) for as
    # long as the test holds it; tests/server/test_connection_age.py sets the age it tests.
    "max_connection_age_ms": 3_600_000,
}


# The session's plain server (``plain_server``, tests/conftest.py), for the modules whose tests differ
# only in per-call options: what each of them needs of the server, and the defaults otherwise.
PLAIN: dict[str, Any] = {
    "frontends": 2,  # test_api calls each front end
    "admission": "",  # these tests are about answers, not this machine's service rate
    "max_items_per_request": 64,  # a request one item over it stays small
    "served_model_name": "minilm",  # REST's alias (test_rest); the model id is accepted too
    "prompts": json.dumps({"query": "query: ", "passage": "passage: "}),  # the README's (test_readme)
    "default_timeout_ms": 600_000,  # a busy machine never turns the corpus command's calls into retries
}
# The session's held server (``held_server``, tests/conftest.py): its engine computes a batch once
# the test releases it (tests/server/held.py); one front end and one compute lane, so the order
# work is computed in is the order it was queued in; no admission and a long default deadline, so
# every request is answered however busy the machine.
HELD: dict[str, Any] = {"frontends": 1, "admission": "", "compute_lanes": 1, "default_timeout_ms": 600_000}


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class ServerProcess:
    """``held=True`` serves through ``tests.server.held``: ``self.engine`` then holds its batches
    (the real model computes them once released).

    ``running`` holds the servers started and not yet stopped: a failing test's report carries the
    end of their logs (``tests/server/conftest.py``), the only trace of a failure on CI."""

    running: ClassVar[list[ServerProcess]] = []

    def __init__(self, log: Path, module: str = "kembed", held: bool = False, **settings: Any) -> None:
        """``nofile=N`` among the settings: the file descriptors each process may open (``ulimit -n``);
        ``environ={...}``: variables other than settings (``CXX``...)."""
        nofile = int(settings.pop("nofile", 0))
        environ: Mapping[str, str] = settings.pop("environ", {})
        values = {**FAST, **listen.ANY_PORTS, **settings}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEMBED_")}
        env.update({env_name(k): str(v) for k, v in values.items()})
        env["HF_HUB_OFFLINE"] = "1"
        env.update(environ)
        self.engine = EngineHold(log.with_suffix(".hold"))
        if held:
            module = "tests.server.held"
            env[HOLD_ENV] = str(self.engine.path)
        self.log = log
        self._out = log.open("wb")
        command = [sys.executable, "-m", module]
        if nofile:  # set by prlimit, not a preexec_fn: forking this gRPC-using process crashes in gRPC's
            # fork handlers now and then (an epoll_wait on a closed fd, grpc/grpc#43055); posix_spawn does not
            command = ["prlimit", f"--nofile={nofile}", "--", *command]
        self.process = subprocess.Popen(command, env=env, stdout=self._out, stderr=subprocess.STDOUT)
        self._ports: dict[str, int] = {}
        ServerProcess.running.append(self)

    def wait_ready(self, timeout: float = 300) -> ServerProcess:
        self.ports(timeout)
        wait_until(lambda: self.http("/readyz")[0] == 200 or self.process.poll() is not None, timeout, "ready")
        if self.process.poll() is not None:
            raise AssertionError(f"server exited with {self.process.returncode}:\n{self.output()}")
        return self

    def ports(self, timeout: float = 300) -> dict[str, int]:
        """The ports the server bound (``grpc``, ``rest``, ``http``), once its first line names them."""
        if not self._ports:
            said = lambda: listen.listening_ports(self.output()) is not None  # noqa: E731
            wait_until(lambda: said() or self.process.poll() is not None, timeout, "the server's ports")
            found = listen.listening_ports(self.output())
            if found is None:
                raise AssertionError(f"server exited with {self.process.returncode} unbound:\n{self.output()}")
            self._ports = found
        return self._ports

    @property
    def grpc_port(self) -> int:
        return self.ports()["grpc"]

    @property
    def rest_port(self) -> int:
        return self.ports()["rest"]

    @property
    def http_port(self) -> int:
        return self.ports()["http"]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def rest_url(self) -> str:
        """The OpenAI API's base URL (what the official client calls ``base_url``)."""
        return f"http://127.0.0.1:{self.rest_port}/v1"

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return 0, ""

    def metric(self, sample: str) -> float:
        """One sample off ``/metrics`` by its full name and labels (0 when it is not there yet). A
        failed scrape raises: read as 0, it would pass a wait for a gauge to fall."""
        status, body = self.http("/metrics")
        assert status == 200, f"/metrics answered {status}"
        found = re.search(rf"^{re.escape(sample)} (\S+)$", body, re.M)
        return float(found.group(1)) if found else 0.0

    def health(self) -> dict[str, Any]:
        status, body = self.http("/health")
        assert status == 200
        return dict(json.loads(body))

    def wait_open_requests(self, count: int, timeout: float = 120) -> None:
        """Until the engine holds exactly ``count`` admitted requests (every one past the gates)."""
        wait_until(lambda: self.health()["open_requests"] == count, timeout, f"{count} requests in the engine")

    def children(self) -> dict[str, int]:
        """The supervisor's children by role (``engine``, ``frontend-0``...), from their command lines."""
        found = {}
        for pid in Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"kembed.engine" in argv:
                found["engine"] = int(pid)
            elif b"kembed.frontend" in argv:
                found[f"frontend-{argv[argv.index(b'--index') + 1].decode()}"] = int(pid)
        return found

    def runtime(self) -> Path:
        """The supervisor's runtime folder (engine socket, board, metrics), from its engine's command line."""
        argv = Path(f"/proc/{self.children()['engine']}/cmdline").read_bytes().split(b"\0")
        return Path(argv[argv.index(b"--runtime") + 1].decode())

    def terminate(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def stop(self) -> None:
        if self in ServerProcess.running:
            ServerProcess.running.remove(self)
        self.engine.release()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._out.close()


@contextlib.contextmanager
def serving(folder: Path, held: bool = False, **settings: Any) -> Iterator[ServerProcess]:
    """A server started in ``folder`` (its log, its hold file) and ready; stopped at the end, also
    when it never got ready."""
    server = ServerProcess(folder / "server.log", held=held, **settings)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def server_fixture(
    held: bool = False, scope: Literal["module", "session"] = "module", **settings: Any
) -> Callable[..., Iterator[ServerProcess]]:
    """A fixture of one server with ``settings`` (``ServerProcess``'s), set up once for the module
    that assigns it (``server = server_fixture(admission="")``: the fixture takes the name it is
    assigned to) or, with ``scope="session"``, for the session."""

    @pytest.fixture(scope=scope)
    def fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        with serving(tmp_path_factory.mktemp(request.fixturename or "server"), held, **settings) as server:
            yield server

    return fixture


def the_plain_server() -> Callable[..., ServerProcess]:
    """The session's plain server as a module's fixture, named as assigned: ``server = the_plain_server()``."""

    @pytest.fixture(scope="module")
    def fixture(plain_server: ServerProcess) -> ServerProcess:
        return plain_server

    return fixture


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmHWM``: its peak since :func:`reset_peak_rss`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def reset_peak_rss(pid: int) -> None:
    """Start ``VmHWM`` again from the present resident memory (Linux's clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def all_decided(server: ServerProcess, futures: list[grpc.Future]) -> bool:
    """Every call answered (refused: the engine is held) or admitted into the engine."""
    return sum(f.done() for f in futures) + server.health()["open_requests"] == len(futures)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def peer_ports(pid: int, local_port: int) -> set[int]:
    """Remote ports of the established TCP connections that ``pid`` holds on ``local_port``."""
    inodes = _socket_inodes(pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if state == "01" and inode in inodes and int(local.rsplit(":", 1)[1], 16) == local_port:
                ports.add(int(remote.rsplit(":", 1)[1], 16))
    return ports


def channel_per_frontend(server: ServerProcess, count: int) -> dict[str, grpc.Channel]:
    """One connected channel held by each front end, by role (``frontend-0``...).

    SO_REUSEPORT hands each new connection to a front end by hash: open channels until each front
    end holds one (64 tries: a chance of 2**-63 to miss one of two).
    """
    found: dict[str, grpc.Channel] = {}
    for _ in range(64):
        # A local subchannel pool: a channel to the same target would otherwise share one connection.
        channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
        role = _frontend_of(server, channel)
        if role in found:
            channel.close()
        else:
            found[role] = channel
        if len(found) == count:
            return found
    raise AssertionError(f"new connections reached only {sorted(found)}")


def _frontend_of(server: ServerProcess, channel: grpc.Channel) -> str:
    """Which front end a fresh channel's connection landed on."""
    before = {role: peer_ports(pid, server.grpc_port) for role, pid in server.children().items()}
    pb_grpc.EmbedderStub(channel).Info(pb.InfoRequest(), timeout=10)
    for role, pid in server.children().items():
        if peer_ports(pid, server.grpc_port) - before[role]:
            return role
    raise AssertionError("no front end holds the new connection")
