"""The client as users call it, against a real server (real model, gRPC and REST over loopback):
any number of texts through ``embed`` (split within the server's limits, answered in order), the
request options as arguments, the asyncio client, the one-shot command's flags and errors, and a
model served from a folder under the name clients know it by."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kembed.client import AsyncEmbedClient, EmbedClient, EmbedError, InvalidInput, decode
from kembed.client.__main__ import main
from kembed.client.requests import Limits, Options, plan
from kembed.engine.model import BUNDLED_MODEL_ID
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, serving

pytestmark = pytest.mark.process

FOLDER = "minilm-folder"  # the model's folder: what it is called unless told otherwise
MAX_TEXT_CHARS = 2000
MAX_MESSAGE = 64 * 1024
TOPICS = ["pods", "nodes", "vectors", "queues", "tokens", "shards", "replicas", "graphs"]
# More texts than a request may carry (2,048), of a few tokens each.
MANY = [f"note {i} on {TOPICS[i % len(TOPICS)]} and {TOPICS[i * 7 % len(TOPICS)]}" for i in range(2500)]
SMALL_REQUEST = 16
BATCH_ANSWERS = 'kembed_request_duration_seconds_count{priority="batch"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, bundled_path: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("client")
    folder = root / FOLDER
    folder.mkdir()
    for file in bundled_path.iterdir():  # the bundled model's files, in a folder of another name
        (folder / file.name).symlink_to(file)
    with serving(
        root,
        admission="",  # these tests are about the client, not the machine's service rate
        model=str(folder),
        served_model_name=BUNDLED_MODEL_ID,  # the README's model=
        max_text_chars=MAX_TEXT_CHARS,
        max_message_bytes=MAX_MESSAGE,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def in_small_requests(server: ServerProcess) -> np.ndarray:
    """MANY embedded SMALL_REQUEST at a time, with the plain stub: what embed must equal."""
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        answers = [
            stub.Embed(pb.EmbedRequest(texts=MANY[i : i + SMALL_REQUEST]), timeout=300)
            for i in range(0, len(MANY), SMALL_REQUEST)
        ]
    return np.concatenate([decode(answer) for answer in answers])


def test_embed_takes_more_texts_than_a_request_carries(server: ServerProcess, in_small_requests: np.ndarray):
    with EmbedClient(server.target, timeout_s=300) as client:
        vectors = client.embed(MANY)
    assert vectors.shape == (len(MANY), 384)
    np.testing.assert_allclose(vectors, in_small_requests, atol=1e-5)  # in order, row for row


def test_embed_splits_by_the_servers_message_limit(server: ServerProcess):
    """Forty texts of 1,900 characters weigh more than a request may (64 KiB): several requests."""
    long = [f"{i} " + "lorem ipsum dolor sit amet " * 70 for i in range(40)]
    with EmbedClient(server.target, timeout_s=300) as client:
        vectors = client.embed(long, truncate=True)
        one_by_one = np.concatenate([client.embed([text], truncate=True) for text in long[:3]])
    assert vectors.shape == (40, 384)
    np.testing.assert_allclose(vectors[:3], one_by_one, atol=1e-5)


def test_truncate_cuts_a_text_past_the_servers_character_limit(server: ServerProcess):
    text = "word " * (MAX_TEXT_CHARS // 5) + "and more past the limit"
    with EmbedClient(server.target) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.embed([text])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        cut = client.embed([text], truncate=True, dimensions=64)
    assert cut.shape == (1, 64)


def test_truncated_left_a_text_past_the_character_limit_keeps_its_end(server: ServerProcess):
    """The client cuts the text as the server would: to its last ``max_text_chars`` characters."""
    text = "head " + "word " * (MAX_TEXT_CHARS // 5) + "and the end"
    parts = plan([text], Options(truncate=True, truncation_direction="left"), Limits(8, MAX_MESSAGE, MAX_TEXT_CHARS))
    assert list(parts[0].request.texts) == [text[-MAX_TEXT_CHARS:]]
    assert parts[0].request.truncation_direction == pb.TRUNCATION_DIRECTION_LEFT
    with EmbedClient(server.target) as client:
        with pytest.raises(InvalidInput) as refused:
            client.embed([text], truncate=True, truncation_direction="up")
        assert refused.value.message == "truncation_direction: 'up' is not right or left (in any case)"
        left = client.embed([text], truncate=True, truncation_direction="left")
        tail = client.embed([text[-MAX_TEXT_CHARS:]], truncate=True, truncation_direction="left")
        upper = client.embed([text], truncate=True, truncation_direction="LEFT")  # as TEI and REST take it
    np.testing.assert_allclose(left, tail, atol=2e-6)
    np.testing.assert_allclose(upper, left, atol=2e-6)


def test_an_error_names_the_text_in_the_whole_list(server: ServerProcess):
    texts = list(MANY[:1500])
    texts[1200] = "x" * (MAX_TEXT_CHARS + 1)  # in a later request of the list than the first
    with EmbedClient(server.target, timeout_s=300) as client, pytest.raises(grpc.RpcError) as refused:
        client.embed(texts)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).startswith("texts[1200]: "), refused.value.details()


def test_priority_batch_reaches_the_server_as_batch(server: ServerProcess):
    before = server.metric(BATCH_ANSWERS)
    with EmbedClient(server.target, timeout_s=300) as client:
        client.embed(MANY[:2048], priority="batch")  # parts of 64 texts and more
        with pytest.raises(
            InvalidInput, match=r"^INVALID_ARGUMENT: priority: 'bulk' is not one of interactive, batch$"
        ):
            client.embed(MANY[:1], priority="bulk")
    assert server.metric(BATCH_ANSWERS) >= before + 2  # more than a request carries: at least two


def test_one_string_is_refused_naming_texts(server: ServerProcess):
    with EmbedClient(server.target) as client, pytest.raises(InvalidInput, match=r"texts: a list of strings"):
        client.embed("hello world")


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ([], "texts: an empty list: nothing to embed"),  # not "texts, tokens: exactly one..." (issue 59)
        (["ok", None], "texts[1]: None is not a str"),
        (["ok", "fine", ""], "texts[2]: an empty string"),
        ([7], "texts[0]: 7 is not a str"),
        ([b"bytes"], "texts[0]: b'bytes' is not a str"),
    ],
)
def test_bad_texts_are_refused_before_sending_naming_the_text(server: ServerProcess, texts: list, message: str):
    with EmbedClient(server.target) as client, pytest.raises(EmbedError) as refused:
        client.embed(texts)
    assert isinstance(refused.value, InvalidInput)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and refused.value.message == message
    assert str(refused.value) == f"INVALID_ARGUMENT: {message}"


def test_a_server_error_is_an_embed_error_on_one_line(server: ServerProcess):
    with EmbedClient(server.target) as client, pytest.raises(EmbedError) as refused:
        client.embed(["hello"], dimensions=10_000)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "\n" not in str(refused.value) and "debug_error_string" not in str(refused.value)
    assert not isinstance(refused.value.__context__, grpc.Call)  # no raw call object rides along


def test_the_async_client_answers_as_the_sync_one(server: ServerProcess, in_small_requests: np.ndarray):
    async def embed() -> tuple[np.ndarray, np.ndarray, pb.InfoResponse]:
        async with AsyncEmbedClient(server.target, timeout_s=300) as client:
            many, short = await asyncio.gather(
                client.embed(MANY, priority="batch"), client.embed(MANY[:2], dimensions=128)
            )
            return many, short, await client.info()

    before = server.metric(BATCH_ANSWERS)
    many, short, info = asyncio.run(embed())
    np.testing.assert_allclose(many, in_small_requests, atol=1e-5)
    assert short.shape == (2, 128)
    assert info.served_model_name == BUNDLED_MODEL_ID
    assert server.metric(BATCH_ANSWERS) >= before + 3  # 2,500 texts: requests of at most 2,048, within the budget


def test_the_async_client_names_the_text_at_fault(server: ServerProcess):
    async def embed() -> None:
        async with AsyncEmbedClient(server.target, timeout_s=300) as client:
            await client.embed([*MANY[:1100], "x" * (MAX_TEXT_CHARS + 1)])

    with pytest.raises(grpc.RpcError) as refused:
        asyncio.run(embed())
    assert str(refused.value.details()).startswith("texts[1100]: "), refused.value.details()


# --- the one-shot command -----------------------------------------------------------------------


def test_the_command_answers_an_over_long_text_in_one_line(server: ServerProcess, capsys: pytest.CaptureFixture[str]):
    long = "x" * (MAX_TEXT_CHARS + 1)
    assert main(["--target", server.target, "hello", long]) == 1
    said = capsys.readouterr()
    assert said.out == ""
    assert (
        said.err
        == f"kembed.client: INVALID_ARGUMENT: texts[1]: {MAX_TEXT_CHARS + 1} characters, more than {MAX_TEXT_CHARS}\n"
    )


def test_the_command_takes_the_request_options(server: ServerProcess, capsys: pytest.CaptureFixture[str]):
    before = server.metric(BATCH_ANSWERS)
    flags = ["--target", server.target, "--truncate", "--dimensions", "32", "--priority", "batch"]
    assert main([*flags, "hello", "x" * (MAX_TEXT_CHARS + 1)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"model {FOLDER}: 2 x 32 in ")
    assert server.metric(BATCH_ANSWERS) == before + 1


def printed_values(line: str) -> np.ndarray:
    """The first values of a vector as the command prints them: ``'text' [+0.0123, -0.0456, ..., ...]``."""
    return np.array([float(value) for value in re.findall(r"[+-]\d\.\d{4}", line)], dtype=np.float32)


def test_the_command_truncates_left_keeping_a_texts_end(server: ServerProcess, capsys: pytest.CaptureFixture[str]):
    """A text past the model's 256 tokens: with --truncation-direction left its vector is that of its
    last tokens, the library's truncation_direction="left", not the start's."""
    text = "pods and nodes " * 60 + "the queue drains the shards at last " * 30  # 1,980 characters, 400 tokens
    flags = ["--target", server.target, "--truncate", "--truncation-direction", "Left"]  # any case, as TEI writes it
    assert main([*flags, text]) == 0
    printed = printed_values(capsys.readouterr().out.splitlines()[1])
    with EmbedClient(server.target) as client:
        left = client.embed([text], truncate=True, truncation_direction="left")[0, :6]
        right = client.embed([text], truncate=True)[0, :6]
    assert printed.shape == (6,)
    np.testing.assert_allclose(printed, left, atol=1e-4)  # printed to 4 decimals
    assert np.abs(printed - right).max() > 1e-3


def test_the_commands_truncation_direction_changes_nothing_without_truncate(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
):
    """As the request's field on the server: a short text is embedded as ever, a long one refused as ever."""
    flags = ["--target", server.target, "--truncation-direction", "left"]
    assert main([*flags, "hello world"]) == 0
    printed = printed_values(capsys.readouterr().out.splitlines()[1])
    with EmbedClient(server.target) as client:
        np.testing.assert_allclose(printed, client.embed(["hello world"])[0, :6], atol=1e-4)
    assert main([*flags, "x" * (MAX_TEXT_CHARS + 1)]) == 1
    assert f"INVALID_ARGUMENT: texts[0]: {MAX_TEXT_CHARS + 1} characters" in capsys.readouterr().err


# --- the served name ----------------------------------------------------------------------------


def test_a_model_from_a_folder_answers_to_its_served_name(server: ServerProcess):
    """The README's model= reaches a model served from a folder, once KEMBED_SERVED_MODEL_NAME names it."""
    body = json.dumps({"model": BUNDLED_MODEL_ID, "input": ["hello world"]}).encode()
    request = urllib.request.Request(
        server.rest_url + "/embeddings", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert json.loads(answer.read())["model"] == BUNDLED_MODEL_ID
    with urllib.request.urlopen(server.rest_url + "/models", timeout=60) as answer:
        assert [model["id"] for model in json.loads(answer.read())["data"]] == [BUNDLED_MODEL_ID, FOLDER]
    with EmbedClient(server.target) as client:
        info = client.info()
    assert (info.model_id, info.served_model_name) == (FOLDER, BUNDLED_MODEL_ID)
