"""Start-up, readiness gating, deadlines, SIGTERM drain and child failures, on real servers: the
supervisor, its engine and two front ends as separate processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kembed.contract import EXIT_FATAL, RETRY_PUSHBACK_KEY
from kembed.ipc.board import Board, Cell, FrontendCell
from kembed.ipc.protocol import PROTOCOL_VERSION, Hello, frame
from kembed.plumbing.runtime import BOARD_FILE, ENGINE_SOCKET
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.held import EngineHold
from tests.server.serving import ServerProcess, channel_per_frontend, wait_until
from tests.server.test_rest import post

JSON = "application/json"
PARAGRAPH = "Readiness goes false at once, and everything accepted is finished and answered. " * 5

pytestmark = pytest.mark.process


def process_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_a_life_on_both_edges_warming_up_serving_then_draining(tmp_path: Path):
    """Warming up, gRPC answers UNAVAILABLE and REST 503, /readyz 503 and /livez 200; warm, both
    serve; on SIGTERM readiness drops, a new call is refused on both edges with the pushback gRPC's
    retry policy and the openai SDK retry after (on another replica), every call accepted in every
    front end, gRPC's and REST's, is answered, and the server exits 0. One server's life: three
    tests each started a server for a stage of it (merged from test_lifecycle's warming-up and
    SIGTERM tests and test_rest's warming-up-and-draining test)."""
    warming = EngineHold(tmp_path / "server.hold")
    warming.hold()  # the engine's warmup waits until released, however fast this machine is
    server = ServerProcess(tmp_path / "server.log", held=True, admission="", frontends=2)
    try:
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_until(lambda: _health_status(health) is not None, 120, "a front end listening")
            assert _health_status(health) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["too early"]), timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "warming up" in str(caught.value.details())
            wait_until(lambda: post(server, {"input": "early"})[0] == 503, 120, "the REST port answering 503")
            assert server.http("/readyz")[0] == 503
            assert server.http("/livez")[0] == 200
            warming.release()
            server.wait_ready()
            assert _health_status(health) == health_pb2.HealthCheckResponse.SERVING
            assert pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["now"])).count == 1
        _drains_on_both_edges(server)
    finally:
        server.stop()
    assert server.output().count("draining:") == 2


def _drains_on_both_edges(server: ServerProcess) -> None:
    channels = channel_per_frontend(server, 2)
    with ThreadPoolExecutor(6) as pool, server.engine:  # nothing is computed until the drain has been checked
        accepted = []
        for channel in channels.values():
            stub = pb_grpc.EmbedderStub(channel)
            accepted += [stub.Embed.future(pb.EmbedRequest(texts=[PARAGRAPH] * 8), timeout=120) for _ in range(10)]
        by_rest = [pool.submit(post, server, {"input": [f"accepted {i}"] * 4}) for i in range(6)]
        server.wait_open_requests(26)  # every request is past the gate, in the engine
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: server.http("/readyz")[0] != 200, 60, "readiness to drop")
        for channel in channels.values():
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["after SIGTERM"]), timeout=30)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
            # a pushback, so gRPC's retry policy sends it again (on another replica)
            trailing: Any = caught.value.trailing_metadata()  # the stubs type it as a tuple of Never
            assert dict(trailing)[RETRY_PUSHBACK_KEY] == "100"
        status, body, headers = post(server, {"input": "after SIGTERM"})
        assert status == 503 and body["error"]["code"] == "unavailable"
        assert headers["retry-after-ms"] == "100"  # the openai SDK retries a 503 after it
        assert not any(future.done() for future in [*accepted, *by_rest])  # every one still in flight
    assert [future.result().count for future in accepted] == [8] * 20
    assert [(status, len(body["data"])) for status, body, _ in (f.result(timeout=120) for f in by_rest)] == [
        (200, 4)
    ] * 6
    assert server.process.wait(timeout=60) == 0
    for channel in channels.values():
        channel.close()


def _health_status(health: health_pb2_grpc.HealthStub) -> int | None:
    try:
        return int(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status)
    except grpc.RpcError:
        return None


def test_expired_work_is_dropped_before_compute(held_server: ServerProcess):
    server = held_server
    real = 'kembed_tokens_total{kind="real"}'
    before = server.metric(real)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        with server.engine:  # the backlog's first batch waits: the late request waits behind it
            backlog = stub.Embed.future(pb.EmbedRequest(texts=[PARAGRAPH] * 64), timeout=120)
            server.wait_open_requests(1)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(pb.EmbedRequest(texts=["late"] * 3), timeout=0.2)
            assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            server.wait_open_requests(1)  # the engine dropped it
        answered = backlog.result()
    # The expired request never reached the model: the tokens computed are the backlog's alone.
    wait_until(lambda: server.metric(real) - before >= sum(answered.token_counts), 60, "the tokens counted")
    assert server.metric(real) - before == sum(answered.token_counts)


def test_calls_that_end_before_their_answer_are_counted_not_logged(held_server: ServerProcess):
    """Calls whose deadline passes while the engine holds them: at its deadline gRPC's core ends each
    call as the front end answers DEADLINE_EXCEEDED, and whichever comes first, each is answered
    (counted by its code) or gone (counted as such), never a failure with a traceback in the log (at
    8a781ed an answer the core refused logged ExecuteBatchError's traceback at ERROR). Calls their
    clients cancel are gone too."""
    late, cancelled = 300, 20
    server = held_server
    expired = 'kembed_requests_total{api="grpc",code="DEADLINE_EXCEEDED"}'
    gone = 'kembed_calls_gone_total{api="grpc"}'
    before = {name: server.metric(name) for name in (expired, gone)}
    logged = len(server.output())
    with grpc.insecure_channel(server.target) as channel, server.engine:
        stub = pb_grpc.EmbedderStub(channel)
        expiring = [stub.Embed.future(pb.EmbedRequest(texts=[f"late {i}"]), timeout=0.3) for i in range(late)]
        for call in expiring:
            assert call.exception(timeout=120).code() is grpc.StatusCode.DEADLINE_EXCEEDED
        leaving = [stub.Embed.future(pb.EmbedRequest(texts=[f"left {i}"]), timeout=120) for i in range(cancelled)]
        server.wait_open_requests(cancelled)
        for call in leaving:
            call.cancel()
        counted = lambda: sum(server.metric(name) - before[name] for name in before) == late + cancelled  # noqa: E731
        wait_until(counted, 120, "every call counted once: answered DEADLINE_EXCEEDED, or gone")
    assert server.metric(gone) - before[gone] >= cancelled
    said = server.output()[logged:]
    assert "Traceback" not in said and " ERROR " not in said


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def _answers(host: str, server: ServerProcess) -> bool:
    """gRPC's Embed, REST's /v1/embeddings and the health port, each over ``host``."""
    with grpc.insecure_channel(f"{host}:{server.grpc_port}") as channel:
        assert pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["over IPv6"]), timeout=60).count == 1
    request = urllib.request.Request(
        f"http://{host}:{server.rest_port}/v1/embeddings", data=b'{"input": "a"}', headers={"Content-Type": JSON}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert len(json.loads(response.read())["data"]) == 1
    with urllib.request.urlopen(f"http://{host}:{server.http_port}/readyz", timeout=60) as response:
        return bool(response.status == 200)


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize(
    ("host", "reached_over"),
    [("::", ("[::1]", "127.0.0.1")), ("[::1]", ("[::1]",)), ("::1", ("[::1]",))],
    ids=["both families", "IPv6 loopback in brackets", "IPv6 loopback"],
)
def test_listens_on_ipv6(tmp_path: Path, host: str, reached_over: tuple[str, ...]):
    """Every port (gRPC, REST, health) on an IPv6 address, and on both families on ``::``, the
    operator's choice (at 8a781ed ``::`` failed to bind gRPC's port and ``[::1]`` to resolve)."""
    server = ServerProcess(tmp_path / "server.log", frontends=1, grpc_host=host, http_host=host)
    try:
        wait_until(lambda: _ready(server, reached_over[0]) or server.process.poll() is not None, 300, "ready")
        assert server.process.poll() is None, server.output()
        for address in reached_over:
            assert _answers(address, server)
    finally:
        server.stop()


def _ready(server: ServerProcess, host: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{server.http_port}/readyz", timeout=10) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.mark.parametrize("victim", ["engine", "frontend-1"])
def test_a_killed_child_takes_the_server_down(tmp_path: Path, victim: str):
    server = ServerProcess(tmp_path / "server.log", frontends=2).wait_ready()
    try:
        children = server.children()
        assert sorted(children) == ["engine", "frontend-0", "frontend-1"]
        os.kill(children[victim], signal.SIGKILL)
        assert server.process.wait(timeout=30) != 0
        wait_until(lambda: all(process_gone(pid) for pid in children.values()), 10, "every child to exit")
    finally:
        server.stop()


BROKEN_LINKS = {
    "garbage": (b"not a frame of the protocol, only bytes " * 4, "bad magic"),
    "another version": (b"".join(frame(Hello(PROTOCOL_VERSION + 1, 9))), "different kembed installs"),
    "an unknown front end": (b"".join(frame(Hello(PROTOCOL_VERSION, 1))), "HELLO from front end 1, of 1"),
}


@pytest.mark.parametrize("case", list(BROKEN_LINKS))
def test_a_link_that_breaks_the_protocol_takes_the_server_down(tmp_path: Path, case: str):
    data, reason = BROKEN_LINKS[case]
    server = ServerProcess(tmp_path / "server.log", frontends=1).wait_ready()
    try:
        with socket.socket(socket.AF_UNIX) as link:  # a front end that does not speak the protocol
            link.connect(str(server.runtime() / ENGINE_SOCKET))
            link.sendall(data)
            assert server.process.wait(timeout=120) == EXIT_FATAL
        assert reason in server.output()
    finally:
        server.stop()


def test_bad_configuration_exits_naming_the_variable():
    result = subprocess.run(
        [sys.executable, "-m", "kembed"],
        env={**os.environ, "KEMBED_MAX_BATCH_SIZE": "many"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "KEMBED_MAX_BATCH_SIZE" in result.stderr


def test_missing_model_fails_start_up(tmp_path: Path):
    server = ServerProcess(tmp_path / "server.log", model="/nonexistent/model")
    try:
        assert server.process.wait(timeout=180) == 1
        assert "/nonexistent/model" in server.output()
    finally:
        server.stop()


def test_answers_a_stream_left_unread_when_the_drain_ended_are_counted(tmp_path: Path):
    server = ServerProcess(tmp_path / "server.log", admission="", drain_timeout_s=1).wait_ready()
    offered = 32
    # 16 rows an answer (24 KiB): the client's 64 KiB window (no BDP probing) takes a few of them.
    request = pb.EmbedRequest(texts=["read me if you can"] * 16)
    silent = grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)])
    try:
        # Never read; its requests' deadline is the stream's, so none expires on a slow machine.
        stream = pb_grpc.EmbedderStub(silent).EmbedStream(iter([request] * offered), timeout=900)
        ok = 'kembed_requests_total{api="grpc",code="OK"}'
        wait_until(lambda: server.metric(ok) == offered, 600, "every request to be computed")
        assert server.terminate() == 0
        stream.cancel()
    finally:
        silent.close()
        server.stop()
    output = server.output()
    in_frontend = re.search(r"drain: dropped (\d+) computed answers", output)
    in_supervisor = re.search(r"the drain dropped (\d+) computed stream answers", output)
    assert in_frontend is not None and in_supervisor is not None, output
    assert 0 < int(in_frontend.group(1)) == int(in_supervisor.group(1)) < offered


def test_a_failed_start_leaves_no_runtime_files_and_clears_a_killed_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    killed = ServerProcess(tmp_path / "killed.log", frontends=1)
    try:
        wait_until(lambda: len(killed.children()) == 2, 120, "the engine and the front end to start")
        children = killed.children()
        board = Board(killed.runtime() / BOARD_FILE)
        # Both tick, so both watch for their supervisor's death: a child that has not yet looked up
        # its parent when the supervisor dies takes the reaper for it, and never exits.
        ticking = lambda: board[Cell.ENGINE_HEARTBEAT] > 0 and board.frontend(0, FrontendCell.HEARTBEAT) > 0  # noqa: E731
        wait_until(ticking, 120, "both children to tick")
        killed.process.kill()  # SIGKILL: no clean-up runs
        killed.process.wait()
        wait_until(lambda: all(process_gone(pid) for pid in children.values()), 60, "its children to exit")
    finally:
        killed.stop()
    assert len(list(temporary.glob("kembed-*"))) == 1  # what a SIGKILL leaves behind
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        failed = ServerProcess(tmp_path / "failed.log", http_port=port)
        try:
            assert failed.process.wait(timeout=120) == 1
        finally:
            failed.stop()
    refusal = f"cannot start: [Errno 98] HTTP port 127.0.0.1:{port}: Address already in use (set KEMBED_HTTP_PORT"
    assert refusal in failed.output()
    assert list(temporary.iterdir()) == []  # the stale folder removed, and none of its own left
