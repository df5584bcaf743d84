"""``POST /tokenize``: the ids and counts an embedding call computes, prompt, truncation and chunks
applied as that call applies them, its usage included."""

from __future__ import annotations

import json
from typing import Any

import grpc
import numpy as np
import pytest

from kembed.client import EmbedClient, decode
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import PLAIN, ServerProcess, the_plain_server
from tests.server.test_rest import post, post_to

pytestmark = pytest.mark.process

PROMPTS = json.loads(PLAIN["prompts"])
LONG = "kubernetes scales embedding servers on their own metrics " * 60  # about 600 tokens: past 256
TEXTS = ["hello world", "naïve café 東京", LONG]


def tokenize(server: ServerProcess, body: dict[str, Any]) -> tuple[int, Any, Any]:
    return post_to(server.rest_url.removesuffix("/v1") + "/tokenize", body)


server = the_plain_server()


CALLS: dict[str, dict[str, Any]] = {
    "truncated": {"truncate": True},
    "a prompt, truncated": {"truncate": True, "prompt_name": "query"},
    "chunked, with a prompt": {"chunk": True, "prompt": "passage: "},
}


@pytest.mark.parametrize("case", CALLS)
def test_tokenize_counts_what_the_embedding_call_computes(
    server: ServerProcess, stub: pb_grpc.EmbedderStub, hf_tokenizer: Any, case: str
) -> None:
    fields = CALLS[case]
    status, tokens, _ = tokenize(server, {"input": TEXTS, **fields})
    assert status == 200, tokens
    status, embedded, _ = post(server, {"input": TEXTS, **fields})
    assert status == 200, embedded
    assert tokens["usage"] == embedded["usage"]
    answer = stub.Embed(pb.EmbedRequest(texts=TEXTS, **fields), timeout=120)
    assert [item["count"] for item in tokens["data"]] == list(answer.token_counts)
    for item in tokens["data"]:
        assert item["count"] == sum(map(len, item["tokens"]))
    prompt = PROMPTS.get(fields.get("prompt_name", ""), fields.get("prompt", ""))
    short = hf_tokenizer(prompt + TEXTS[0])["input_ids"]
    assert tokens["data"][0]["tokens"] == [short]
    long = tokens["data"][2]["tokens"]
    if fields.get("chunk"):
        assert len(long) > 1 and all(len(chunk) <= 256 for chunk in long)
        prompt_ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert all(chunk[1 : 1 + len(prompt_ids)] == prompt_ids for chunk in long)  # each chunk starts with it
    else:
        assert [len(chunk) for chunk in long] == [256]


def test_tokenize_refuses_as_the_embedding_call_does(server: ServerProcess) -> None:
    status, body, _ = tokenize(server, {"input": [LONG], "truncate": False, "chunk": False})
    assert status == 400 and body["error"]["param"] == "input[0]"
    status, body, _ = tokenize(server, {"input": ["a"], "prompt_name": "nope"})
    assert status == 400 and body["error"]["param"] == "prompt_name"


TAIL = "the start that left truncation cuts " + LONG + "and the end it keeps"


@pytest.mark.parametrize("prompt", ["", "query"])
def test_left_truncation_keeps_the_texts_tail_after_the_prompt(
    server: ServerProcess, stub: pb_grpc.EmbedderStub, hf_tokenizer: Any, prompt: str
) -> None:
    """``truncation_direction: left`` keeps [CLS], the prompt (a prefix, never cut), then the tokens of
    the text's tail; a text within the limit is as it is. The embedding call computes those ids: on
    REST, on gRPC, and from the client, as the pre-tokenized ids would be."""
    fields = {"truncate": True, "truncation_direction": "left", "prompt_name": prompt}
    status, tokens, _ = tokenize(server, {"input": [TAIL, "hello world"], **fields})
    assert status == 200, tokens
    whole = hf_tokenizer(TAIL)["input_ids"]
    prompt_ids = hf_tokenizer(PROMPTS.get(prompt, ""), add_special_tokens=False)["input_ids"]
    ids = [whole[0], *prompt_ids, *whole[len(whole) - (255 - len(prompt_ids)) :]]
    assert tokens["data"][0]["tokens"] == [ids]
    assert tokens["data"][1]["tokens"] == [hf_tokenizer(PROMPTS.get(prompt, "") + "hello world")["input_ids"]]
    left = pb.TRUNCATION_DIRECTION_LEFT
    answer = stub.Embed(pb.EmbedRequest(texts=[TAIL], truncate=True, truncation_direction=left, prompt_name=prompt))
    pretokenized = pb.TokenIds(ids=np.asarray(ids, dtype="<i4").tobytes(), lengths=[len(ids)])
    np.testing.assert_allclose(decode(answer), decode(stub.Embed(pb.EmbedRequest(tokens=pretokenized))), atol=2e-6)
    status, embedded, _ = post(server, {"input": [TAIL], **fields})
    assert status == 200, embedded
    np.testing.assert_allclose(np.asarray([embedded["data"][0]["embedding"]]), decode(answer), atol=2e-6)
    with EmbedClient(server.target, timeout_s=120) as client:
        vectors = client.embed([TAIL], truncate=True, truncation_direction="left", prompt_name=prompt)
        np.testing.assert_allclose(vectors, decode(answer), atol=2e-6)
        right = client.embed([TAIL], truncate=True, prompt_name=prompt)
    assert float(vectors[0] @ right[0]) < 0.99  # the other end of the text


def test_left_truncation_of_ids_keeps_the_first_and_the_last(stub: pb_grpc.EmbedderStub) -> None:
    ids = [101, *range(1000, 1300), 102]
    request = pb.EmbedRequest(
        tokens=pb.TokenIds(ids=np.asarray(ids, dtype="<i4").tobytes(), lengths=[len(ids)]),
        truncate=True,
        truncation_direction=pb.TRUNCATION_DIRECTION_LEFT,
    )
    kept = [101, *ids[len(ids) - 255 :]]
    expected = pb.EmbedRequest(tokens=pb.TokenIds(ids=np.asarray(kept, dtype="<i4").tobytes(), lengths=[256]))
    answer = stub.Embed(request, timeout=120)
    assert list(answer.token_counts) == [256]
    np.testing.assert_allclose(decode(answer), decode(stub.Embed(expected, timeout=120)), atol=2e-6)


@pytest.mark.process
@pytest.mark.parametrize("text", [" ", "\u200b", "\t\n", "\x00", "\ufeff"])
def test_a_text_without_content_is_refused_on_every_edge_naming_it(
    server: ServerProcess, stub: pb_grpc.EmbedderStub, text: str
) -> None:
    """As the empty text is: embedded, it would be [CLS] [SEP] alone (``kembed/domain/texts.py``)."""
    for call in (post, tokenize):
        status, body, _ = call(server, {"input": ["hello", text]})
        assert (status, body["error"]["param"]) == (400, "input[1]"), body
        assert "only whitespace or invisible characters" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Embed(pb.EmbedRequest(texts=["hello", text]), timeout=120)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert str(caught.value.details()).startswith("texts[1]: no letter")
