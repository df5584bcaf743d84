"""The client's API key, against a gRPC server over loopback that admits only calls saying
``authorization: Bearer KEY`` (the server's own check is tested with the server): every kind of
call carries it, the library's and the commands', read from a key file as the server reads its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kembed.client import Connection, EmbedClient, EmbedError
from kembed.client.__main__ import main
from kembed.client.connection import API_KEY_FILE_VAR
from kembed.contract import RETRY_ATTEMPT_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.in_process import served

KEY = "kembed-test-key-1"
DIMENSIONS = 4


class Guarded(pb_grpc.EmbedderServicer):
    """Answers (zero vectors) only calls that carry the key, and notes every call's metadata."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def _admit(self, context: grpc.ServicerContext) -> None:
        metadata = {key: str(value) for key, value in context.invocation_metadata()}
        self.seen.append(metadata)
        if metadata.get("authorization") != f"Bearer {KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        self._admit(context)
        return pb.InfoResponse(model_id="guarded", dimensions=DIMENSIONS, max_batch_items=1024)

    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        self._admit(context)
        return answer(request)

    def EmbedStream(self, requests: Iterator[pb.EmbedRequest], context: grpc.ServicerContext) -> Iterator:
        self._admit(context)
        for request in requests:
            yield answer(request)


def answer(request: pb.EmbedRequest) -> pb.EmbedResponse:
    count = len(request.texts)
    vectors = np.zeros((count, DIMENSIONS), dtype="<f4").tobytes()
    ones = [1] * count
    return pb.EmbedResponse(
        embeddings=vectors, count=count, dimensions=DIMENSIONS, token_counts=ones, request_id=request.request_id
    )


@pytest.fixture
def guarded() -> Iterator[tuple[str, Guarded]]:
    servicer = Guarded()
    with served(servicer) as target:
        yield target, servicer


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """The server's format: one key a line; the first is the client's, the next one rotated out."""
    path = tmp_path / "api-keys"
    path.write_text(f"\n{KEY}\nkembed-old-key\n")
    return path


def test_unary_and_stream_calls_carry_the_key_beside_their_own_metadata(guarded: tuple[str, Guarded]) -> None:
    target, servicer = guarded

    async def calls() -> None:
        async with Connection(target, api_key=KEY).aio_channel() as channel:
            stub = pb_grpc.EmbedderStub(channel)
            await stub.Info(pb.InfoRequest(), metadata=((RETRY_ATTEMPT_KEY, "1"),), timeout=10)
            stream = stub.EmbedStream(timeout=10)  # as the corpus command drives it
            await stream.write(pb.EmbedRequest(texts=["a", "b"]))
            await stream.done_writing()
            assert [reply.count async for reply in stream] == [2]

    asyncio.run(calls())
    info, stream = servicer.seen
    assert info["authorization"] == stream["authorization"] == f"Bearer {KEY}"
    assert info[RETRY_ATTEMPT_KEY] == "1"


def test_the_library_sends_the_key_and_is_refused_without_it(guarded: tuple[str, Guarded]) -> None:
    target, _ = guarded
    with EmbedClient(Connection(target, api_key=KEY)) as client:
        assert client.embed(["hello", "world"]).shape == (2, DIMENSIONS)
    with EmbedClient(target, api_key=KEY) as client:  # the keyword builds the same connection
        assert client.embed(["hello"]).shape == (1, DIMENSIONS)
    with EmbedClient(target) as client, pytest.raises(EmbedError) as refused:
        client.info()
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_the_key_stays_out_of_the_connections_repr() -> None:
    assert KEY not in repr(Connection(api_key=KEY))
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        Connection(api_key="two words")


def test_the_commands_read_the_key_file_named_by_the_flag_or_the_servers_variable(
    guarded: tuple[str, Guarded], key_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, servicer = guarded
    assert main(["--target", target, "--api-key-file", str(key_file), "hello"]) == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello\nworld\n")
    monkeypatch.setenv(API_KEY_FILE_VAR, str(key_file))
    embed = ["embed", "--target", target, "--input", str(corpus), "--output", str(tmp_path / "out.npy")]
    assert main([*embed, "--no-progress"]) == 0  # the corpus command, as an EmbeddingJob's pods run it
    assert np.load(tmp_path / "out.npy").shape == (2, DIMENSIONS)
    assert {seen["authorization"] for seen in servicer.seen} == {f"Bearer {KEY}"}


def test_a_key_file_without_a_key_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(SystemExit) as usage:
            main(["--api-key-file", str(path), "hello"])
        assert usage.value.code == 2
        assert "--api-key-file" in capsys.readouterr().err
