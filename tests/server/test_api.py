"""The gRPC API end to end: a real server (two front ends and an engine) on loopback, the real model,
real clients. Calls that must hold for every front end run once through each."""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kembed.client import EmbedClient, decode
from kembed.config.settings import Settings
from kembed.contract import GRPC_SERVICE, Metric
from kembed.engine.model import resolve_model_path
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import PLAIN, ServerProcess, channel_per_frontend, the_plain_server

pytestmark = pytest.mark.process

MAX_ITEMS = PLAIN["max_items_per_request"]
MAX_MESSAGE = Settings.model_fields["max_message_bytes"].default

TEXTS = [
    "hello world",
    "Kubernetes schedules pods onto nodes.",
    "A short one.",
    "Embeddings map text to vectors so that similar meanings land close together. " * 6,
    "naïve café, 東京, emoji 🚀",
    " \t spaced\n\n out \t ",  # whitespace around and between words: the tokenizer's to drop
    "def f(x):\n    return x * 2",
]


FRONTENDS = ("frontend-0", "frontend-1")


# No admission strategies: these tests are about the API, and a busy machine's service rate
# would otherwise refuse some of their bursts (test_overload covers admission end to end).
server = the_plain_server()


@pytest.fixture(scope="module")
def channels(server: ServerProcess) -> Iterator[dict[str, grpc.Channel]]:
    found = channel_per_frontend(server, len(FRONTENDS))
    yield found
    for chan in found.values():
        chan.close()


@pytest.fixture(scope="module", params=FRONTENDS)
def channel(request: pytest.FixtureRequest, channels: dict[str, grpc.Channel]) -> grpc.Channel:
    return channels[request.param]


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.EmbedderStub:
    return pb_grpc.EmbedderStub(channel)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    _, path = resolve_model_path(Settings())
    model = SentenceTransformer(str(path), device="cpu")
    return np.asarray(model.encode(TEXTS, normalize_embeddings=True))


def test_embeddings_match_sentence_transformers(stub: pb_grpc.EmbedderStub, reference: np.ndarray):
    vectors = decode(stub.Embed(pb.EmbedRequest(texts=TEXTS, truncate=True)))
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    cosines = np.sum(vectors * reference, axis=1)
    assert cosines.min() >= 0.9999, cosines


def test_an_empty_text_is_refused_naming_it(stub: pb_grpc.EmbedderStub):
    """One rule on every edge, OpenAI's: an empty text is refused, not embedded as its special tokens."""
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=["hello", ""]), timeout=60)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "texts[1]: an empty string"


def test_pretokenized_ids_give_the_same_vectors(server: ServerProcess):
    from transformers import AutoTokenizer

    _, path = resolve_model_path(Settings())
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    texts = TEXTS[:3]
    sequences = tokenizer(texts)["input_ids"]
    with EmbedClient(server.target) as client:
        from_ids = client.embed_tokens(sequences)
        from_texts = client.embed(texts)
    np.testing.assert_allclose(from_ids, from_texts, atol=1e-5)


def test_dimensions_truncate_and_renormalize(stub: pb_grpc.EmbedderStub):
    full = decode(stub.Embed(pb.EmbedRequest(texts=["matryoshka"], normalize=False)))
    short = stub.Embed(pb.EmbedRequest(texts=["matryoshka"], dimensions=64, request_id="m1"))
    vectors = decode(short)
    assert (short.count, short.dimensions, short.request_id) == (1, 64, "m1")
    assert np.linalg.norm(vectors[0]) == pytest.approx(1.0, abs=1e-5)
    expected = full[0, :64] / np.linalg.norm(full[0, :64])
    np.testing.assert_allclose(vectors[0], expected, atol=1e-5)
    assert np.linalg.norm(full[0]) != pytest.approx(1.0, abs=1e-3)  # normalize=false is raw


def test_response_reports_tokens_and_timings(stub: pb_grpc.EmbedderStub):
    response = stub.Embed(pb.EmbedRequest(texts=["one two three", "x"]))
    assert list(response.token_counts) == [5, 3]  # [CLS] ... [SEP]
    assert response.timings.total_ms >= response.timings.inference_ms > 0


def test_info_describes_the_model(stub: pb_grpc.EmbedderStub):
    info = stub.Info(pb.InfoRequest())
    assert info.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert (info.dimensions, info.max_input_tokens, info.vocab_size) == (384, 256, 30522)
    assert list(info.buckets) == [16, 32, 64, 128, 256]
    assert list(info.batch_sizes) == [1, 2, 4, 8, 16]
    assert info.pooling == "mean" and info.batching == "token_bucket"
    assert (info.max_text_chars, info.max_message_bytes) == (100_000, MAX_MESSAGE)
    assert re.fullmatch(r"[0-9a-f]{64}", info.tokenizer_fingerprint)


def ids(*values: int) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


BAD_REQUESTS = {
    "neither": (pb.EmbedRequest(), "texts: empty, and no tokens"),
    "both": (pb.EmbedRequest(texts=["a"], tokens=pb.TokenIds(ids=ids(101, 102), lengths=[2])), "texts, tokens"),
    "bytes not int32": (pb.EmbedRequest(tokens=pb.TokenIds(ids=b"\x01\x02\x03", lengths=[1])), "tokens.ids"),
    "lengths do not sum": (pb.EmbedRequest(tokens=pb.TokenIds(ids=ids(101, 102), lengths=[3])), "tokens.lengths"),
    "negative length": (pb.EmbedRequest(tokens=pb.TokenIds(ids=ids(101, 102), lengths=[2**32 - 1])), "tokens.lengths"),
    "zero length": (pb.EmbedRequest(tokens=pb.TokenIds(ids=ids(101, 102), lengths=[2, 0])), "tokens.lengths"),
    "id out of vocab": (pb.EmbedRequest(tokens=pb.TokenIds(ids=ids(101, 999_999, 102), lengths=[3])), "tokens.ids"),
    "negative id": (pb.EmbedRequest(tokens=pb.TokenIds(ids=ids(101, -5, 102), lengths=[3])), "tokens.ids"),
    "over-long text": (pb.EmbedRequest(texts=["word " * 400]), "texts[0]"),
    "over-long ids": (pb.EmbedRequest(tokens=pb.TokenIds(ids=ids(*[1000] * 300), lengths=[300])), "tokens"),
    "too many items": (pb.EmbedRequest(texts=["a"] * (MAX_ITEMS + 1)), "texts"),
    "too many dimensions": (pb.EmbedRequest(texts=["a"], dimensions=385), "dimensions"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_input_is_rejected_alone(stub: pb_grpc.EmbedderStub, case: str):
    request, field = BAD_REQUESTS[case]
    good = [stub.Embed.future(pb.EmbedRequest(texts=[f"good neighbour {i}"] * 4)) for i in range(3)]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(request, timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert str(caught.value.details()).startswith(field), caught.value.details()
    for future in good:
        assert future.result(timeout=30).count == 4


def test_oversized_message_is_refused(stub: pb_grpc.EmbedderStub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(pb.EmbedRequest(texts=["x" * (MAX_MESSAGE + 10)]), timeout=10)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Embed(pb.EmbedRequest(texts=["still fine"])).count == 1


def test_a_unary_call_without_its_message_is_refused(channel: grpc.Channel):
    """Embed is read as a client stream (a slot is taken before its message): a client that
    half-closes without sending one is told so; one that sends two is answered for the first."""
    embed = channel.stream_unary(
        f"/{GRPC_SERVICE}/Embed", pb.EmbedRequest.SerializeToString, pb.EmbedResponse.FromString
    )
    with pytest.raises(grpc.RpcError) as caught:
        embed(iter(()), timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "no EmbedRequest was sent"
    two = iter([pb.EmbedRequest(texts=["first"], request_id="1"), pb.EmbedRequest(texts=["second"], request_id="2")])
    assert embed(two, timeout=30).request_id == "1"


def test_stream_answers_many_requests_and_isolates_a_bad_one(stub: pb_grpc.EmbedderStub):
    requests = [pb.EmbedRequest(texts=[f"stream text {i}"] * (1 + i % 3), request_id=f"r{i}") for i in range(20)]
    requests[7] = pb.EmbedRequest(texts=["word " * 400], request_id="r7")
    answers = {answer.request_id: answer for answer in stub.EmbedStream(iter(requests), timeout=60)}
    assert sorted(answers) == sorted(f"r{i}" for i in range(20))
    assert answers["r7"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers["r7"].error.message.startswith("texts[0]")
    for i in (0, 1, 2, 19):
        assert answers[f"r{i}"].count == 1 + i % 3 and not answers[f"r{i}"].HasField("error")


def test_grpc_health_and_reflection(channel: grpc.Channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kembed.v1.Embedder"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {service.name for reply in replies for service in reply.list_services_response.service}
    assert {"kembed.v1.Embedder", "grpc.health.v1.Health"} <= names


def test_http_probes_health_and_metrics(server: ServerProcess, stub: pb_grpc.EmbedderStub):
    stub.Embed(pb.EmbedRequest(texts=["metrics please"]))
    assert server.http("/livez")[0] == 200
    assert server.http("/readyz")[0] == 200
    health = server.health()
    assert health["status"] == "healthy" and health["accepting_requests"] is True
    assert health["embedding_dimension"] == 384 and health["service_rate_tokens_per_sec"] > 0
    for key in ("queued_tokens", "estimated_drain_time_ms", "p95_server_side_latency_ms", "worker_queue_depth"):
        assert key in health
    status, text = server.http("/metrics")
    assert status == 200
    for name in (
        Metric.DEMAND_RATIO,
        Metric.QUEUE_DRAIN_SECONDS,
        Metric.LATENCY_P95_SECONDS,
        Metric.REQUEST_DURATION_SECONDS + "_bucket",
        Metric.QUEUED_TOKENS,
        Metric.SERVICE_RATE,
        Metric.BATCH_SIZE + "_bucket",
        Metric.BATCH_TOKENS + "_bucket",
        Metric.INFERENCE_SECONDS + "_bucket",
    ):
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert re.search(r'^kembed_requests_total\{api="grpc",code="OK"\} [1-9]', text, re.M)
    assert re.search(r'^kembed_tokens_total\{kind="padding"\} ', text, re.M)
    assert server.http("/nope")[0] == 404
