"""``KEMBED_API_KEY_FILE``: the keys read at start-up (one a line, several for a rotation; a file
that holds none stops the start), compared in constant time; then a real server that requires one.
The official ``openai`` SDK and LangChain's ``OpenAIEmbeddings`` are served with a key and refused
without it (401 in OpenAI's shape, decided from the request's head before its body is read); gRPC
calls to the Embedder service are UNAUTHENTICATED without ``authorization`` metadata, while gRPC
health and reflection, and the REST port's description of itself, stay open."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from langchain_openai import OpenAIEmbeddings
from pydantic import SecretStr

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.contract import EXIT_CONFIG
from kembed.plumbing.api_keys import ApiKeys, read
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess

OLD, NEW = "kembed-old-key-0123456789", "kembed-new-key-9876543210"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def keys_in(tmp_path: Path, text: str) -> ApiKeys | None:
    path = tmp_path / "keys"
    path.write_text(text)
    return read(Settings.from_env({}, api_key_file=str(path)))


def test_no_file_requires_no_key():
    assert read(Settings.from_env({})) is None


def test_every_key_of_the_file_is_taken_for_a_rotation(tmp_path: Path):
    keys = keys_in(tmp_path, f"{OLD}\n\n  {NEW}  \n")
    assert keys is not None and len(keys.digests) == 2
    assert keys.allows(f"Bearer {OLD}") and keys.allows(f"Bearer {NEW}")
    assert keys.allows(f"bearer {NEW}") and keys.allows(f"BEARER {NEW}")  # the scheme in any case (RFC 9110)


@pytest.mark.parametrize(
    "presented", [None, "", "Bearer", "Bearer ", f"Basic {OLD}", f"Bearer {OLD}x", f"Bearer {OLD[:-1]}", OLD]
)
def test_anything_else_is_refused(tmp_path: Path, presented: str | None):
    keys = keys_in(tmp_path, OLD)
    assert keys is not None and not keys.allows(presented)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "holds no key"),
        ("\n \n", "holds no key"),
        ("a key with spaces", "key 1 is not printable ASCII"),
        ("ok\nkéy", "cannot read"),
    ],
)
def test_a_file_without_good_keys_is_a_configuration_error(tmp_path: Path, text: str, says: str):
    with pytest.raises(ConfigError, match=f"^KEMBED_API_KEY_FILE: .*{says}"):
        keys_in(tmp_path, text)


@pytest.mark.process
def test_a_missing_file_stops_the_start_with_the_configuration_exit_code(tmp_path: Path):
    env = {"KEMBED_API_KEY_FILE": str(tmp_path / "nowhere"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "kembed"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.startswith("kembed: configuration error: KEMBED_API_KEY_FILE: cannot read"), done.stderr


# --- a server that requires a key -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("keys")
    (folder / "keys").write_text(f"{OLD}\n{NEW}\n")
    running = ServerProcess(folder / "server.log", api_key_file=str(folder / "keys"))
    yield running.wait_ready()
    running.stop()


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


@pytest.mark.process
@pytest.mark.parametrize("key", [OLD, NEW])
def test_the_openai_sdk_is_served_with_a_key(server: ServerProcess, key: str):
    client = openai.OpenAI(base_url=server.rest_url, api_key=key, max_retries=0)
    answer = client.embeddings.create(model=MODEL, input=["hello world", "two texts"])
    assert len(answer.data) == 2 and len(answer.data[0].embedding) == 384


@pytest.mark.process
def test_the_openai_sdk_is_refused_without_a_key(server: ServerProcess):
    client = openai.OpenAI(base_url=server.rest_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.embeddings.create(model=MODEL, input=["hello world"])
    assert refused.value.status_code == 401
    assert refused.value.body == {
        "message": "the API key is not one this server takes",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.process
def test_langchain_is_served_with_a_key_and_refused_without(server: ServerProcess):
    def embeddings(key: str) -> OpenAIEmbeddings:
        return OpenAIEmbeddings(  # the README's arguments (base_url, api_key), by the names mypy knows
            model=MODEL,
            openai_api_base=server.rest_url,
            openai_api_key=SecretStr(key),
            check_embedding_ctx_length=False,
            max_retries=0,
        )

    assert len(embeddings(NEW).embed_query("hello world")) == 384
    assert len(embeddings(OLD).embed_documents(["a", "b", "c"])) == 3
    with pytest.raises(openai.AuthenticationError):
        embeddings("unused").embed_query("hello world")


@pytest.mark.process
def test_a_call_without_a_key_is_refused_from_its_head_before_its_body_is_read(server: ServerProcess):
    """A head that announces a 1 MB body, and no body: the 401 comes at once, and the connection closes."""
    with socket.create_connection(("127.0.0.1", server.rest_port), timeout=30) as sock:
        head = "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 1000000\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized"
    head_bytes, _, body = rest.partition(b"\r\n\r\n")
    assert b'www-authenticate: bearer realm="kembed"' in head_bytes.lower()
    assert orjson.loads(body)["error"]["message"] == "no API key: send one as Authorization: Bearer KEY"


@pytest.mark.process
def test_the_description_of_the_api_needs_no_key(server: ServerProcess):
    base = f"http://127.0.0.1:{server.rest_port}"
    with urllib.request.urlopen(f"{base}/openapi.json", timeout=30) as answer:
        described = orjson.loads(answer.read())
    assert described["paths"]["/v1/embeddings"]["post"]["security"] == [{"apiKey": []}]
    with urllib.request.urlopen(f"{base}/docs", timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("text/html") and b"/v1/embeddings" in answer.read()


@pytest.mark.process
def test_grpc_calls_need_the_key_in_their_metadata(server: ServerProcess):
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        request = pb.EmbedRequest(texts=["hello world"])
        assert stub.Embed(request, metadata=bearer(NEW), timeout=60).count == 1
        assert stub.Info(pb.InfoRequest(), metadata=bearer(OLD), timeout=60).dimensions == 384
        answers = list(stub.EmbedStream(iter([request, request]), metadata=bearer(OLD), timeout=60))
        assert [a.count for a in answers] == [1, 1]
        for call in (
            lambda metadata: stub.Embed(request, metadata=metadata, timeout=60),
            lambda metadata: stub.Info(pb.InfoRequest(), metadata=metadata, timeout=60),
            lambda metadata: list(stub.EmbedStream(iter([request]), metadata=metadata, timeout=60)),
        ):
            for metadata, says in ((None, "no API key"), (bearer("unused"), "the API key is not one")):
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert (refused.value.details() or "").startswith(says)
        # Health stays open (kubelet's gRPC probe sends no metadata), and so does reflection.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        asked = reflection_pb2.ServerReflectionRequest(list_services="")
        listed = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([asked]), timeout=60))
        assert "kembed.v1.Embedder" in {service.name for service in listed.list_services_response.service}
    assert server.metric('kembed_requests_total{api="grpc",code="UNAUTHENTICATED"}') >= 6
    assert server.metric('kembed_requests_total{api="rest",code="401"}') >= 1
