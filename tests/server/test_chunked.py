"""Long inputs as chunks (``chunk``), end to end: a real server with chunking on by default, the real
model, and each chunked vector checked against its chunks embedded one by one as pre-tokenized
input and combined here. The split and combination alone: test_chunks."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import grpc
import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from kembed.client import AsyncEmbedClient, EmbedClient, decode
from kembed.client.__main__ import main
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, server_fixture

pytestmark = pytest.mark.process

LIMIT = 256  # the bundled model's max input tokens
MAX_CHUNKS = 4
MAX_ITEMS = 8
SHORT = "Kubernetes schedules pods onto nodes."
# About 600 tokens: three chunks of the model's length.
LONG = " ".join(
    f"Section {i}: embeddings map text to vectors, and a long document's chunks are averaged by their tokens."
    for i in range(30)
)
TOO_LONG = LONG * 2  # more than four chunks
# 200 tokens at the head of every chunk leave 54 of a text's own: LONG needs 11 chunks with it, not 3.
LONG_PROMPT = "a " * 200
PROMPTED_MOST = 2 + 200 + MAX_CHUNKS * 54


# No admission: these tests are about the answers, not the machine's service rate.
server = server_fixture(
    admission="", chunk_long_inputs=True, max_chunks_per_input=MAX_CHUNKS, max_items_per_request=MAX_ITEMS
)


def chunks_by_hand(ids: list[int]) -> list[list[int]]:
    """[CLS] + a run of the text's own tokens + [SEP], each at most the model's length."""
    own, step = ids[1:-1], LIMIT - 2
    return [[ids[0], *own[i : i + step], ids[-1]] for i in range(0, len(own), step)]


def tokens(sequences: list[list[int]]) -> pb.TokenIds:
    flat = np.concatenate([np.asarray(seq, dtype="<i4") for seq in sequences])
    return pb.TokenIds(ids=flat.tobytes(), lengths=[len(seq) for seq in sequences])


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


@pytest.fixture(scope="module")
def long_ids(hf_tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = list(hf_tokenizer(LONG)["input_ids"])
    assert 2 * LIMIT < len(ids) <= MAX_CHUNKS * (LIMIT - 2) + 2  # three chunks, the last one short
    return ids


@pytest.fixture(scope="module")
def by_hand(stub: pb_grpc.EmbedderStub, long_ids: list[int]) -> tuple[np.ndarray, int]:
    """LONG's vector, unnormalised, from its chunks embedded one by one and averaged by their
    tokens here; and its chunks' tokens."""
    chunks = chunks_by_hand(long_ids)
    rows = [decode(stub.Embed(pb.EmbedRequest(tokens=tokens([c]), normalize=False), timeout=120))[0] for c in chunks]
    weights = np.array([len(c) for c in chunks], dtype=np.float64)
    return (np.asarray(rows, np.float64) * weights[:, None]).sum(axis=0) / weights.sum(), int(weights.sum())


def test_a_long_text_is_the_token_weighted_mean_of_its_chunks(
    stub: pb_grpc.EmbedderStub, by_hand: tuple[np.ndarray, int]
) -> None:
    vector, chunk_tokens = by_hand
    answer = stub.Embed(pb.EmbedRequest(texts=[SHORT, LONG], chunk=True), timeout=120)
    got = decode(answer)
    np.testing.assert_allclose(got[1], unit(vector), atol=2e-6)
    short = stub.Embed(pb.EmbedRequest(texts=[SHORT]), timeout=120)
    np.testing.assert_allclose(got[0], decode(short)[0], atol=2e-6)
    assert list(answer.token_counts) == [short.token_counts[0], chunk_tokens]


def test_normalize_and_dimensions_apply_to_the_combined_vector(
    stub: pb_grpc.EmbedderStub, by_hand: tuple[np.ndarray, int]
) -> None:
    vector, _ = by_hand
    raw = decode(stub.Embed(pb.EmbedRequest(texts=[LONG], chunk=True, normalize=False), timeout=120))[0]
    np.testing.assert_allclose(raw, vector, rtol=1e-5, atol=1e-6)
    cut = decode(stub.Embed(pb.EmbedRequest(texts=[LONG], chunk=True, dimensions=64), timeout=120))[0]
    np.testing.assert_allclose(cut, unit(vector[:64]), atol=2e-6)


def test_a_prompt_starts_every_chunk(stub: pb_grpc.EmbedderStub, hf_tokenizer: PreTrainedTokenizerBase) -> None:
    """The prompt and the text tokenized as one, as without chunks; each chunk repeats [CLS] and the
    prompt's tokens at its head, so every chunk is embedded as a query would be."""
    prompt = "query: "
    ids = list(hf_tokenizer(prompt + LONG)["input_ids"])
    head = 1 + len(hf_tokenizer(prompt, add_special_tokens=False)["input_ids"])
    own, step = ids[head:-1], LIMIT - head - 1
    chunks = [[*ids[:head], *own[i : i + step], ids[-1]] for i in range(0, len(own), step)]
    rows = [decode(stub.Embed(pb.EmbedRequest(tokens=tokens([c]), normalize=False), timeout=120))[0] for c in chunks]
    weights = np.array([len(c) for c in chunks], dtype=np.float64)
    vector = (np.asarray(rows, np.float64) * weights[:, None]).sum(axis=0) / weights.sum()
    answer = stub.Embed(pb.EmbedRequest(texts=[LONG], chunk=True, prompt=prompt), timeout=120)
    np.testing.assert_allclose(decode(answer)[0], unit(vector), atol=2e-6)
    assert list(answer.token_counts) == [int(weights.sum())]


def test_pre_tokenized_ids_are_chunked_as_the_text_is(stub: pb_grpc.EmbedderStub, long_ids: list[int]) -> None:
    from_ids = stub.Embed(pb.EmbedRequest(tokens=tokens([long_ids]), chunk=True), timeout=120)
    from_text = stub.Embed(pb.EmbedRequest(texts=[LONG], chunk=True), timeout=120)
    np.testing.assert_allclose(decode(from_ids), decode(from_text), atol=2e-6)
    assert list(from_ids.token_counts) == list(from_text.token_counts)


def test_short_inputs_are_unchanged_by_chunk(stub: pb_grpc.EmbedderStub) -> None:
    texts = [SHORT, "hello world"]
    chunked = stub.Embed(pb.EmbedRequest(texts=texts, chunk=True), timeout=120)
    plain = stub.Embed(pb.EmbedRequest(texts=texts, chunk=False), timeout=120)
    np.testing.assert_allclose(decode(chunked), decode(plain), atol=2e-6)
    assert list(chunked.token_counts) == list(plain.token_counts)


def test_the_servers_default_chunks_unless_the_request_says_otherwise(
    stub: pb_grpc.EmbedderStub, by_hand: tuple[np.ndarray, int]
) -> None:
    default = stub.Embed(pb.EmbedRequest(texts=[LONG]), timeout=120)  # KEMBED_CHUNK_LONG_INPUTS=true
    np.testing.assert_allclose(decode(default)[0], unit(by_hand[0]), atol=2e-6)
    truncated = stub.Embed(pb.EmbedRequest(texts=[LONG], truncate=True), timeout=120)
    assert list(truncated.token_counts) == [LIMIT]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=[SHORT, LONG], chunk=False), timeout=120)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith(f"texts[1]: over the model's {LIMIT} tokens")


MOST = MAX_CHUNKS * (LIMIT - 2) + 2  # the longest input four chunks hold
ADVICE = "; set truncate=true to cut it to fit, or chunk=true to embed it whole as chunks"  # either way out
REFUSED = {
    "an input over the model's limit": (
        pb.EmbedRequest(texts=[SHORT, LONG], chunk=False),
        "texts[1]: ",
        f"over the model's {LIMIT} tokens{ADVICE}",
    ),
    "pre-tokenized ids over the model's limit": (
        pb.EmbedRequest(tokens=tokens([[101, *[1000] * LIMIT, 102]]), chunk=False),
        "tokens.lengths[0]: ",
        f"{LIMIT + 2} tokens, longer than the model's {LIMIT} tokens{ADVICE}",
    ),
    "chunk with truncate": (
        pb.EmbedRequest(texts=[LONG], chunk=True, truncate=True),
        "chunk: ",
        "chunk and truncate are both true: choose one",
    ),
    "an input over its chunks": (
        pb.EmbedRequest(texts=[SHORT, TOO_LONG], chunk=True),
        "texts[1]: ",
        f"the {MOST} tokens of {MAX_CHUNKS} chunks (max_chunks_per_input); split it",
    ),
    "an input over its chunks with a prompt at the head of each": (  # issue 45: at f4e9599, a request's worth
        pb.EmbedRequest(texts=[LONG], chunk=True, prompt=LONG_PROMPT),
        "texts[0]: ",
        f"the {PROMPTED_MOST} tokens of {MAX_CHUNKS} chunks that each repeat the prompt's 200 (max_chunks_per_input); "
        "split it or shorten the prompt",
    ),
    "more chunks than a request holds": (
        pb.EmbedRequest(texts=[LONG] * 3, chunk=True),
        "texts: needs at least ",
        f"chunks, more than the {MAX_ITEMS} items a request holds (max_batch_items)",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_limits_are_refused_naming_the_field(stub: pb_grpc.EmbedderStub, case: str) -> None:
    request, field, reason = REFUSED[case]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(request, timeout=120)
    details = refused.value.details() or ""
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field) and reason in details, details


def test_a_long_prompt_still_embeds_a_text_of_one_chunk(stub: pb_grpc.EmbedderStub) -> None:
    chunked = stub.Embed(pb.EmbedRequest(texts=[SHORT], chunk=True, prompt=LONG_PROMPT), timeout=120)
    plain = stub.Embed(pb.EmbedRequest(texts=[SHORT], chunk=False, prompt=LONG_PROMPT), timeout=120)
    np.testing.assert_allclose(decode(chunked), decode(plain), atol=2e-6)
    assert list(chunked.token_counts) == list(plain.token_counts) and chunked.token_counts[0] > 200


def test_pre_tokenized_ids_over_their_chunks_are_refused_by_their_exact_length(stub: pb_grpc.EmbedderStub) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(tokens=tokens([[101, *[1000] * MOST, 102]]), chunk=True), timeout=120)
    assert (refused.value.details() or "").startswith(f"tokens.lengths[0]: {MOST + 2} tokens, longer than the {MOST}")


def test_info_tells_the_chunk_limit_and_default(stub: pb_grpc.EmbedderStub) -> None:
    info = stub.Info(pb.InfoRequest(), timeout=60)
    assert (info.max_chunks_per_input, info.chunk_long_inputs) == (MAX_CHUNKS, True)


# --- REST -----------------------------------------------------------------------------------------


def post(server: ServerProcess, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        server.rest_url + "/embeddings", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_rest_chunks_and_usage_counts_every_chunks_tokens(
    server: ServerProcess, by_hand: tuple[np.ndarray, int]
) -> None:
    vector, chunk_tokens = by_hand
    status, body = post(server, {"input": [LONG], "chunk": True})
    assert status == 200
    np.testing.assert_allclose(np.asarray(body["data"][0]["embedding"]), unit(vector), atol=2e-6)
    assert body["usage"] == {"prompt_tokens": chunk_tokens, "total_tokens": chunk_tokens}


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"input": [SHORT, LONG], "chunk": False}, "input[1]", f"over the model's {LIMIT} tokens{ADVICE}"),
        ({"input": LONG, "chunk": True, "truncate": True}, "chunk", "chunk: chunk and truncate are both true"),
        ({"input": [SHORT, TOO_LONG], "chunk": True}, "input[1]", f"the {MOST} tokens of {MAX_CHUNKS} chunks"),
        ({"input": [LONG] * 3}, "input", "needs at least"),
        ({"input": [SHORT, LONG], "prompt": LONG_PROMPT}, "input[1]", "chunks that each repeat the prompt's 200"),
    ],
)
def test_rest_refusals_name_the_field(server: ServerProcess, body: dict[str, Any], param: str, reason: str) -> None:
    status, answer = post(server, body)
    message = answer["error"]["message"]
    assert (status, answer["error"]["param"]) == (400, param)
    assert message.startswith(f"{param}: ") and reason in message, message


# --- the client -----------------------------------------------------------------------------------


def test_the_client_takes_chunk(server: ServerProcess, by_hand: tuple[np.ndarray, int]) -> None:
    with EmbedClient(server.target, timeout_s=120) as client:
        chunked = client.embed([LONG] * 5, chunk=True)  # 15 chunks: requests of two texts
        with pytest.raises(grpc.RpcError) as refused:
            client.embed([LONG], chunk=False)
    np.testing.assert_allclose(chunked, np.tile(unit(by_hand[0]), (5, 1)), atol=2e-6)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    async def embed() -> np.ndarray:
        async with AsyncEmbedClient(server.target, timeout_s=120) as client:
            return await client.embed([LONG, SHORT], chunk=True)

    np.testing.assert_allclose(asyncio.run(embed())[0], unit(by_hand[0]), atol=2e-6)


def test_the_command_takes_chunk(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--target", server.target, "--no-chunk", LONG]) == 1
    assert "INVALID_ARGUMENT: texts[0]: over the model's" in capsys.readouterr().err
    assert main(["--target", server.target, "--chunk", LONG]) == 0
    assert ": 1 x 384 in " in capsys.readouterr().out
