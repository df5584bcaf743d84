"""The OpenAI-compatible REST edge end to end: a real server on loopback, the real model, and the
official ``openai`` client (plus plain HTTP where the client would not send what is tested)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from kembed.client import decode
from kembed.config.settings import Settings
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import PLAIN, ServerProcess, the_plain_server, wait_until

ALIAS = PLAIN["served_model_name"]
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
MAX_ITEMS = PLAIN["max_items_per_request"]
MAX_MESSAGE = Settings.model_fields["max_message_bytes"].default
TEXTS = ["hello world", "Kubernetes schedules pods onto nodes.", "naïve café, 東京, emoji 🚀", "A short one."]

pytestmark = pytest.mark.process


server = the_plain_server()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.rest_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def grpc_stub(server: ServerProcess) -> Iterator[pb_grpc.EmbedderStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.EmbedderStub(channel)


Body = bytes | list[int] | dict[str, Any]


def post(server: ServerProcess, body: Body, path: str = "/embeddings") -> tuple[int, Any, Any]:
    """Status, JSON body and headers of one plain POST to the OpenAI API's ``path`` (status 0:
    nobody listens yet)."""
    return post_to(server.rest_url + path, body)


def post_to(url: str, body: Body) -> tuple[int, Any, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers
    except urllib.error.URLError:  # not listening yet
        return 0, None, None


def vectors(response: Any) -> np.ndarray:
    return np.asarray([item.embedding for item in response.data], dtype=np.float32)


def test_vectors_match_the_grpc_path(client: openai.OpenAI, grpc_stub: pb_grpc.EmbedderStub):
    rest = client.embeddings.create(model=ALIAS, input=TEXTS)  # the client asks for base64 by default
    expected = decode(grpc_stub.Embed(pb.EmbedRequest(texts=TEXTS)))
    got = vectors(rest)
    assert got.shape == expected.shape == (len(TEXTS), 384)
    assert np.min(np.sum(got * expected, axis=1)) >= 0.9999
    assert [item.index for item in rest.data] == list(range(len(TEXTS)))
    assert rest.model == ALIAS and rest.object == "list"


def test_float_and_base64_are_the_same_vectors(server: ServerProcess, client: openai.OpenAI):
    floats = vectors(client.embeddings.create(model=MODEL_ID, input=TEXTS, encoding_format="float"))
    status, body, _ = post(server, {"model": ALIAS, "input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    raw = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]])
    np.testing.assert_allclose(raw, floats, atol=1e-6)


def test_dimensions_truncate_and_renormalise(client: openai.OpenAI):
    full = vectors(client.embeddings.create(model=ALIAS, input=TEXTS))
    short = vectors(client.embeddings.create(model=ALIAS, input=TEXTS, dimensions=128))
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)


def test_token_ids_give_the_same_vectors_and_usage_counts_tokens(
    client: openai.OpenAI, grpc_stub: pb_grpc.EmbedderStub
):
    texts = TEXTS[:2]
    by_text = client.embeddings.create(model=ALIAS, input=texts)
    counts = list(grpc_stub.Embed(pb.EmbedRequest(texts=texts)).token_counts)
    from transformers import AutoTokenizer

    from kembed.config.settings import Settings
    from kembed.engine.model import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(Settings())[1])
    ids = [tokenizer(text)["input_ids"] for text in texts]
    by_ids = client.embeddings.create(model=ALIAS, input=ids)
    one = client.embeddings.create(model=ALIAS, input=ids[0])  # a single array of ids
    np.testing.assert_allclose(vectors(by_ids), vectors(by_text), atol=1e-5)
    np.testing.assert_allclose(vectors(one)[0], vectors(by_text)[0], atol=1e-5)
    assert by_text.usage.prompt_tokens == by_text.usage.total_tokens == sum(counts) == sum(map(len, ids))


def test_every_field_the_openai_client_sends_is_taken(client: openai.OpenAI):
    """What the SDK's create sends (LangChain's OpenAIEmbeddings sends a subset: model, input as
    token ids, dimensions), and kembed's extensions through extra_body."""
    response = client.embeddings.create(
        model=ALIAS,
        input=TEXTS[:2],
        dimensions=384,
        encoding_format="float",
        user="someone",
        extra_body={"truncate": True, "priority": "batch"},
    )
    assert vectors(response).shape == (2, 384)


def test_an_unknown_field_is_refused_naming_it(client: openai.OpenAI):
    """Ignored, a misspelt option would be lost without a word (OpenAI refuses it too)."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=ALIAS, input="hi", extra_body={"promt": "query: "})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "promt", error
    assert error["message"].startswith("promt: not a field of this API"), error


def test_models_lists_the_alias_and_the_id(client: openai.OpenAI):
    assert [model.id for model in client.models.list().data] == [ALIAS, MODEL_ID]


BAD_BODIES: dict[str, tuple[Body, int, str | None]] = {
    "not JSON": (b"{input: nope", 400, None),
    "not an object": ([1, 2], 400, None),
    "no input": ({"model": ALIAS}, 400, "input"),
    "empty input": ({"input": []}, 400, "input"),
    "an empty string": ({"input": ["fine", ""]}, 400, "input[1]"),
    "wrong type": ({"input": {"text": "x"}}, 400, "input"),
    "mixed array": ({"input": ["text", 5]}, 400, "input[1]"),
    "null in a list": ({"input": ["a", "b", "c", None]}, 400, "input[3]"),  # issue 59: its index named
    "a float id": ({"input": [[101, 1.5, 102]]}, 400, "input[0][1]"),
    "an id outside int32": ({"input": [101, 2**40, 102]}, 400, "input[1]"),
    "an id outside the vocabulary": ({"input": [[101, 102], [101, 999999, 102]]}, 400, "input[1][1]"),
    "an empty sequence": ({"input": [[101, 102], []]}, 400, "input[1]"),
    "over-long text": ({"input": ["fine", "word " * 400]}, 400, "input[1]"),
    "too many items": ({"input": ["a"] * (MAX_ITEMS + 1)}, 400, "input"),
    "unknown encoding": ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    "dimensions zero": ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    "too many dimensions": ({"input": "x", "dimensions": 385}, 400, "dimensions"),
    "dimensions past uint32": ({"input": "x", "dimensions": 2**32}, 400, "dimensions"),
    "too many sequences": ({"input": [[101, 102]] * (MAX_ITEMS + 1)}, 400, "input"),
    "truncate not a flag": ({"input": "x", "truncate": "yes"}, 400, "truncate"),
    "unknown priority": ({"input": "x", "priority": 1}, 400, "priority"),
    "unknown model": ({"input": "x", "model": "gpt-4"}, 404, "model"),
    "an unknown field": ({"input": "x", "normalise": False}, 400, "normalise"),
    "body over the limit": (json.dumps({"input": "x" * (MAX_MESSAGE + 10)}).encode(), 413, None),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_input_is_refused_alone_in_openai_shape(server: ServerProcess, client: openai.OpenAI, case: str):
    body, status, param = BAD_BODIES[case]
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(client.embeddings.create, model=ALIAS, input=[f"good neighbour {i}"] * 4) for i in range(3)]
        got, answer, _ = post(server, body)
        assert got == status, answer
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
        assert error["message"] and "Traceback" not in error["message"]
        if param is not None:
            assert error["message"].startswith(param), error
        for future in good:
            assert vectors(future.result(timeout=60)).shape == (4, 384)


def test_a_batch_call_is_counted_in_its_class(server: ServerProcess):
    batch = 'kembed_request_duration_seconds_count{priority="batch"}'
    before = server.metric(batch)
    status, body, _ = post(server, {"input": ["an ingest passage"] * 3, "priority": "batch"})
    assert status == 200 and len(body["data"]) == 3
    wait_until(lambda: server.metric(batch) == before + 1, 60, "the batch class counted")


def test_over_long_input_is_truncated_when_asked(server: ServerProcess):
    status, body, _ = post(server, {"input": ["word " * 400], "truncate": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == 256
    status, body, _ = post(server, {"input": ["word " * 400], "truncate": True, "truncation_direction": "LEFT"})
    assert status == 200 and body["usage"]["prompt_tokens"] == 256  # the direction in any case


def test_langchain_embeds_a_long_document_with_truncate_in_extra_body(server: ServerProcess):
    """docs/api.md: LangChain's OpenAIEmbeddings passes model_kwargs to the SDK, extra_body among them."""
    from langchain_openai import OpenAIEmbeddings
    from pydantic import SecretStr

    def embeddings(**more: Any) -> OpenAIEmbeddings:
        return OpenAIEmbeddings(  # the README's arguments, by the names mypy knows
            model=ALIAS,
            openai_api_base=server.rest_url,
            openai_api_key=SecretStr("unused"),
            check_embedding_ctx_length=False,
            max_retries=0,
            **more,
        )

    long_document = "Kubernetes scales embedding servers. " * 100  # about 500 tokens, past the model's 256
    with pytest.raises(openai.BadRequestError, match="input\\[0\\]: over the model's 256 tokens"):
        embeddings().embed_documents([long_document])
    cut = embeddings(model_kwargs={"extra_body": {"truncate": True}}).embed_documents([long_document, "short"])
    assert len(cut) == 2 and len(cut[0]) == 384


def test_the_api_is_described_at_openapi_json_and_docs(server: ServerProcess):
    """Every route this server serves, under its own limits; the page loads nothing (test_openapi)."""
    from openapi_spec_validator import validate

    root = server.rest_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/openapi.json", timeout=60) as answer:
        assert answer.headers["Content-Type"] == "application/json"
        described = json.loads(answer.read())
    validate(described)
    assert set(described["paths"]) == {"/v1/embeddings", "/tokenize", "/v1/models", "/openapi.json", "/docs"}
    texts = described["components"]["schemas"]["EmbeddingsBody"]["properties"]["input"]["oneOf"][1]
    assert texts["maxItems"] == MAX_ITEMS
    with urllib.request.urlopen(f"{root}/docs", timeout=60) as answer:
        assert answer.headers["Content-Type"] == "text/html; charset=utf-8"
        assert b"<code>/v1/embeddings</code>" in answer.read()
    assert post_to(f"{root}/docs", {"input": "x"})[0] == 405


def test_rest_and_grpc_share_a_batch(held_server: ServerProcess):
    # One lane: while the first request's batch is in its hands, the next two queue together.
    server = held_server
    batches = "kembed_batch_size_count"
    with grpc.insecure_channel(server.target) as channel, ThreadPoolExecutor(2) as pool:
        stub = pb_grpc.EmbedderStub(channel)
        before = server.metric(batches)
        with server.engine:  # the first request's batch waits in the model: the next two queue behind it
            first = stub.Embed.future(pb.EmbedRequest(texts=["the first, alone in its batch"]), timeout=120)
            server.wait_open_requests(1)
            by_grpc = stub.Embed.future(pb.EmbedRequest(texts=["from gRPC"]), timeout=120)
            by_rest = pool.submit(post, server, {"input": ["from REST"]})
            server.wait_open_requests(3)
        assert first.result().count == 1 and by_grpc.result().count == 1 and by_rest.result()[0] == 200
    assert server.metric(batches) - before == 2  # the gRPC and the REST call went in one batch


def test_overload_is_429_with_a_retry_after_the_client_honours(tmp_path):
    # The queue cap, not the drain budget, bounds the admitted calls: at most 8 of them, whatever this machine's speed.
    server = ServerProcess(
        tmp_path / "server.log", held=True, frontends=1, max_drain_ms=1000, max_queued_tokens=1024
    ).wait_ready()
    try:
        request = {"input": ["Admission control rejects early instead of queueing into timeouts."] * 8}
        with ThreadPoolExecutor(40) as pool:
            client = openai.OpenAI(base_url=server.rest_url, api_key="unused", max_retries=50)
            refusals = 'kembed_requests_total{api="rest",code="429"}'
            with server.engine:
                backlog = [pool.submit(post, server, request) for _ in range(30)]
                decided = lambda: sum(f.done() for f in backlog) + server.health()["open_requests"] == 30  # noqa: E731
                wait_until(decided, 120, "every call refused or admitted")
                status, body, headers = next(f.result() for f in backlog if f.done())
                assert status == 429 and body["error"]["type"] == "rate_limit_error"
                assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) > 0
                before = server.metric(refusals)
                patient: Future[Any] = pool.submit(client.embeddings.create, model=MODEL_ID, input=request["input"])
                wait_until(lambda: server.metric(refusals) > before, 120, "the client refused")
                assert not patient.done()
            assert vectors(patient.result(timeout=300)).shape == (8, 384)  # retried after the pushback
            assert {f.result()[0] for f in backlog} <= {200, 429}
    finally:
        server.stop()
