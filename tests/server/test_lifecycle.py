"""Start-up, readiness gating, deadlines and SIGTERM drain, on real servers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import FAST, ServerThread

PARAGRAPH = "Readiness goes false at once, and everything accepted is finished and answered. " * 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def spawn(env: dict[str, str]) -> subprocess.Popen[str]:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "kembed"], env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_unavailable_while_warming_up_then_serving():
    server = ServerThread()
    server.start(wait_ready=False)
    try:
        with grpc.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["too early"]), timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "warming up" in str(caught.value.details())
            assert server.http("/readyz")[0] == 503
            assert server.http("/livez")[0] == 200
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            server.call(server.server.wait_ready(), timeout=300)
            assert server.http("/readyz")[0] == 200
            assert pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["now"])).count == 1
    finally:
        server.stop()


def test_expired_work_is_dropped_before_compute():
    server = ServerThread(admission="").start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            backlog = stub.Embed.future(pb.EmbedRequest(texts=["queue ahead"] * 300), timeout=120)
            while server.health()["queued_tokens"] == 0:
                time.sleep(0.005)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(pb.EmbedRequest(texts=["late"] * 3), timeout=0.2)
            assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            answered = backlog.result()
        _, metrics = server.http("/metrics")
        real = re.search(r'^kembed_tokens_total\{kind="real"\} (\S+)', metrics, re.M)
        assert real is not None
        assert float(real.group(1)) == sum(answered.token_counts)  # the expired request never reached the model
    finally:
        server.stop()


def test_sigterm_finishes_accepted_work_then_exits():
    grpc_port, http_port = free_port(), free_port()
    env = {
        "KEMBED_GRPC_PORT": str(grpc_port),
        "KEMBED_HTTP_PORT": str(http_port),
        "KEMBED_ADMISSION": "",
        **{f"KEMBED_{k.upper()}": str(v) for k, v in FAST.items() if k not in ("grpc_port", "http_port")},
    }
    process = spawn(env)
    try:
        wait_until(lambda: http_status(http_port, "/readyz") == 200 or process.poll() is not None, 300, "ready")
        assert process.poll() is None
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.EmbedderStub(channel)
            accepted = [stub.Embed.future(pb.EmbedRequest(texts=[PARAGRAPH] * 8), timeout=120) for _ in range(12)]
            time.sleep(0.5)  # every request is past the gate (tokenized and queued)
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: http_status(http_port, "/readyz") != 200, 2, "readiness to drop")
            with pytest.raises(grpc.RpcError) as caught:
                stub.Embed(pb.EmbedRequest(texts=["after SIGTERM"]), timeout=5)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
            assert [f.result().count for f in accepted] == [8] * 12
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        output = process.communicate()[0]
    assert "draining" in output


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


def test_missing_model_fails_start_up():
    port = free_port()
    process = spawn({"KEMBED_MODEL": "/nonexistent/model", "KEMBED_GRPC_PORT": "0", "KEMBED_HTTP_PORT": str(port)})
    output = process.communicate(timeout=180)[0]
    assert process.returncode == 1
    assert "/nonexistent/model" in output
