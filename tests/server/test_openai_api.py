"""The OpenAI edge's mapping, pure: a JSON body to the domain's call (every limit checked while the
body is read, chunk by chunk, before anything proportional to it is built), a result back to
OpenAI's JSON, and every failure in OpenAI's error shape with the JSON's own field as ``param``.
End to end: test_rest."""

from __future__ import annotations

import base64
import tracemalloc
from typing import Any

import numpy as np
import orjson
import pytest

from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.frontend import openai_api
from kembed.frontend.call import EmbedResult, Limits, Texts, Timings
from kembed.frontend.json_body import Body, parse
from kembed.frontend.openai_api import ApiError, Embeddings, failed
from kembed.frontend.quantize import Encoding
from kembed.frontend.rest import READ_CHUNK
from kembed.policy.priority import Priority
from tests.server.bodies import ONE_ANSWER, SERVICE_REFUSES

SERVED = ("minilm", "sentence-transformers/all-MiniLM-L6-v2")
LIMITS = Limits(max_items=8, max_text_chars=500)


def from_json(data: Any) -> Embeddings:
    return parse(orjson.dumps(data), SERVED, LIMITS)


def refusal(data: Any) -> ApiError:
    """The error a client reads for this JSON body, whichever step refused it."""
    try:
        from_json(data)
    except ApiError as error:
        return error
    except EmbedError as error:
        return failed(error)
    raise AssertionError(f"{data!r} was accepted")


def test_texts_and_options_map_to_the_call() -> None:
    body = orjson.dumps({"input": ["a", "bcd"], "dimensions": 64, "truncate": True, "priority": "batch"})
    parsed = parse(body, SERVED, LIMITS, "rest:peer")
    call = parsed.call
    assert isinstance(call.inputs, Texts) and list(call.inputs.items) == ["a", "bcd"] and call.inputs.chars == 4
    assert (call.dimensions, call.truncate, call.priority, call.peer) == (64, True, Priority.BATCH, "rest:peer")
    assert call.normalize and call.timeout_s is None  # OpenAI's vectors are unit length; no deadline on REST
    assert (parsed.model, parsed.encoding, parsed.nested) == ("minilm", "float", False)


@pytest.mark.parametrize(("fields", "chunk"), [({}, None), ({"chunk": True}, True), ({"chunk": False}, False)])
def test_chunk_maps_to_the_call_absent_as_the_servers_default(fields: dict[str, bool], chunk: bool | None) -> None:
    assert from_json({"input": "a", **fields}).call.chunk is chunk


@pytest.mark.parametrize("field", sorted(openai_api.FIELDS - {"input"}))
def test_null_is_absent_for_every_optional_field(field: str) -> None:
    """docs/api.md: null means absent. At f4e9599 chunk, truncate, priority and model were a 400 (issue 45)."""
    parsed, absent = from_json({"input": "a", field: None}), from_json({"input": "a"})
    assert (parsed.call, parsed.model, parsed.encoding) == (absent.call, absent.model, absent.encoding)


def test_a_lone_string_is_one_text() -> None:
    inputs = from_json({"input": "hello", "model": SERVED[1]}).call.inputs
    assert isinstance(inputs, Texts) and list(inputs.items) == ["hello"]


@pytest.mark.parametrize(
    ("value", "nested", "lengths"), [([101, 7, 102], False, [3]), ([[101, 102], [101, 7, 8, 102]], True, [2, 4])]
)
def test_token_ids_map_to_sequences(value: list[Any], nested: bool, lengths: list[int]) -> None:
    parsed = from_json({"input": value})
    inputs = parsed.call.inputs
    assert isinstance(inputs, Sequences) and parsed.nested is nested
    assert inputs.lengths.tolist() == lengths and inputs.ids.dtype == np.int32
    assert inputs.ids.tolist() == (value if not nested else [i for sequence in value for i in sequence])


BAD_BODIES: dict[str, tuple[Any, int, str | None, str]] = {
    "not an object": ([1, 2], 400, None, "the body must be a JSON object"),
    "no input": ({"model": "minilm"}, 400, "input", "input: missing"),
    "empty input": ({"input": []}, 400, "input", "input: must be"),
    "an empty string": ({"input": ["fine", ""]}, 400, "input[1]", "input[1]: an empty string"),
    "wrong type": ({"input": {"text": "x"}}, 400, "input", "input: must be"),
    "mixed array": ({"input": ["text", 5]}, 400, "input[1]", "input[1]: a number is not a string, as the items"),
    "null among texts": ({"input": ["a", "b", "c", None]}, 400, "input[3]", "input[3]: null is not a string, as"),
    "null first": ({"input": [None, "a"]}, 400, "input[0]", "input[0]: null is not a string, a token id or an array"),
    "a float id": ({"input": [[101, 1.5, 102]]}, 400, "input[0][1]", "input[0][1]: 1.5 is not a token id, a whole"),
    "a bool id": ({"input": [101, True]}, 400, "input[1]", "input[1]: true or false is not a token id, a whole"),
    "a null id": ({"input": [[101], [101, None]]}, 400, "input[1][1]", "input[1][1]: null is not a token id"),
    "an id outside int32": ({"input": [101, 2**40, 102]}, 400, "input[1]", f"input[1]: {2**40} is not a token id"),
    "a negative id": ({"input": [[101, -1]]}, 400, "input[0][1]", "input[0][1]: -1 is not a token id"),
    "an empty sequence": ({"input": [[101, 102], []]}, 400, "input[1]", "input[1]: an empty array of token ids"),
    "a sequence among texts": ({"input": [[101], "text"]}, 400, "input[1]", "input[1]: a string is not an array of"),
    "over-long text": ({"input": ["fine", "x" * 501]}, 400, "input[1]", "input[1]: 501 characters, more than 500"),
    "too many texts": ({"input": ["a"] * 9}, 400, "input", "input: more than 8 inputs, at most 8 per request"),
    "too many sequences": ({"input": [[1]] * 9}, 400, "input", "input: more than 8 inputs, at most 8 per request"),
    "a sequence over the cap": ({"input": [[1], [7] * 501]}, 400, "input[1]", "input[1]: more than 500 token ids"),
    "ids nested too deep": ({"input": [[[101]]]}, 400, "input[0][0]", "input[0][0]: an array is not a token id"),
    "an object among texts": ({"input": ["a", {"b": 1}]}, 400, "input[1]", "input[1]: an object is not a string"),
    "an array in another field": ({"input": "x", "user": ["u"]}, 400, "user", "user: an object or array"),
    "a long field": ({"input": "x", "user": "u" * 1025}, 400, "user", "user: longer than 1024"),
    "an unknown field": ({"input": "x", "inputs": "y"}, 400, "inputs", "inputs: not a field of this API (it takes"),
    "a long unknown field": ({"input": "x", "f" * 2000: 0}, 400, "f" * 64 + "...", "f" * 64 + "...: not a field"),
    "unknown encoding": ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", "encoding_format: 'hex'"),
    "dimensions zero": ({"input": "x", "dimensions": 0}, 400, "dimensions", "dimensions: must be a whole number"),
    "dimensions a string": ({"input": "x", "dimensions": "64"}, 400, "dimensions", "dimensions: must be"),
    "truncate not a flag": ({"input": "x", "truncate": "yes"}, 400, "truncate", "truncate: must be true or false"),
    "chunk not a flag": ({"input": "x", "chunk": 1}, 400, "chunk", "chunk: must be true or false"),
    "unknown truncation direction": (
        {"input": "x", "truncation_direction": "up"},
        400,
        "truncation_direction",
        "truncation_direction: 'up' is not right or left (in any case)",
    ),
    "unknown priority": ({"input": "x", "priority": 1}, 400, "priority", "priority: 1 is not one of"),
    "model not a string": ({"input": "x", "model": 5}, 400, "model", "model: must be a string"),
    "unknown model": ({"input": "x", "model": "gpt-4"}, 404, "model", "model: 'gpt-4' is not served here"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_bodies_are_refused_in_openai_shape_naming_the_field(case: str) -> None:
    data, status, param, message = BAD_BODIES[case]
    error = refusal(data)
    body = orjson.loads(error.body())["error"]
    assert (error.status, body["param"]) == (status, param)
    assert body["message"].startswith(message), body["message"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_a_body_that_is_not_json_is_refused() -> None:
    with pytest.raises(ApiError) as caught:
        parse(b"{input: nope", SERVED, LIMITS)
    assert (caught.value.status, caught.value.param) == (400, None)
    assert caught.value.message.startswith("the body is not JSON")


@pytest.mark.parametrize("item", [[0], "a"], ids=["sequences", "texts"])
def test_a_huge_list_is_refused_at_the_item_past_the_limit_before_the_rest_is_read(item: Any) -> None:
    """4 million items (what a 16 MiB body holds), fed as the REST edge feeds it: refused naming
    ``input`` within the first chunk, nothing sized by the items built."""
    body = orjson.dumps({"input": [item] * 4_000_000})
    reader = Body(LIMITS)
    tracemalloc.start()
    fed: list[int] = []

    def feed_as_it_arrives() -> None:
        for start in range(0, len(body), 16384):
            fed.append(start)
            reader.feed(body[start : start + 16384])

    with pytest.raises(InvalidInput) as caught:
        feed_as_it_arrives()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert fed == [0] and peak < 1 << 20
    assert (failed(caught.value).param, caught.value.reason) == ("input", "more than 8 inputs, at most 8 per request")


def test_a_body_reads_the_same_however_it_is_split() -> None:
    data = {"input": [[101, 2023, 102], [101, 7, 8, 102]], "model": "minilm", "dimensions": 64, "truncate": True}
    body = orjson.dumps(data)
    for size in (1, 2, 3, 7):
        reader = Body(LIMITS)
        for start in range(0, len(body), size):
            reader.feed(body[start : start + size])
        call = reader.finish(SERVED).call
        assert isinstance(call.inputs, Sequences) and call.inputs.lengths.tolist() == [3, 4]
        assert call.inputs.ids.tolist() == [101, 2023, 102, 101, 7, 8, 102] and (call.dimensions, call.truncate) == (
            64,
            True,
        )


def read(body: bytes, size: int) -> tuple[Any, ...]:
    """What ``body`` fed ``size`` bytes at a time reads as: its call, or the error a client reads."""
    reader = Body(LIMITS)
    try:
        for start in range(0, len(body), size):
            reader.feed(body[start : start + size])
        call = reader.finish(SERVED).call
    except ApiError as error:
        return error.status, error.param, error.message
    except EmbedError as error:
        refused = failed(error)
        return refused.status, refused.param, refused.message
    inputs = call.inputs
    items = list(inputs.items) if isinstance(inputs, Texts) else inputs.ids.tolist()
    return 200, items, call.dimensions, call.priority


@pytest.mark.parametrize("case", ONE_ANSWER)
def test_a_body_reads_the_same_however_it_is_cut(case: str) -> None:
    """Whole, and cut at every offset into chunks of a few bytes (an escape, a surrogate pair, a
    number, a field name cut anywhere), and at the edge's chunk size: one answer, the expected one."""
    body, status, param = ONE_ANSWER[case]
    whole = read(body, max(1, len(body)))
    if case in SERVICE_REFUSES:
        status, param = 200, whole[1]
    assert whole[:2] == (status, param) if status != 200 else whole[0] == 200, whole
    for size in (1, 2, 3, 5, 7, 11, READ_CHUNK):
        assert read(body, size) == whole, size


@pytest.mark.parametrize("truncate_first", [True, False], ids=["truncate before input", "truncate after input"])
def test_with_truncate_a_text_over_the_character_limit_is_cut_in_either_field_order(truncate_first: bool) -> None:
    texts = ["ok", "x" * 501, "y" * 9000]
    fields = [("truncate", True), ("input", texts)]
    body = orjson.dumps(dict(fields if truncate_first else fields[::-1]))
    for size in (len(body), 64):  # whole, and fed in pieces
        reader = Body(LIMITS)
        for start in range(0, len(body), size):
            reader.feed(body[start : start + size])
        inputs = reader.finish(SERVED).call.inputs
        assert isinstance(inputs, Texts) and list(inputs.items) == ["ok", "x" * 500, "y" * 500]
        assert inputs.chars == 1002
    error = refusal({"input": texts})  # without truncate the first one over the limit is named
    assert (error.status, error.param) == (400, "input[1]") and "501 characters, more than 500" in error.message


@pytest.mark.parametrize("direction_first", [True, False], ids=["direction before input", "direction after input"])
def test_truncated_left_a_text_over_the_character_limit_keeps_its_end(direction_first: bool) -> None:
    texts = ["ok", "x" * 501 + "end"]
    fields = [("truncate", True), ("truncation_direction", "left"), ("input", texts)]
    call = from_json(dict(fields if direction_first else fields[::-1])).call
    assert isinstance(call.inputs, Texts) and list(call.inputs.items) == ["ok", "x" * 497 + "end"]
    assert call.truncate_left and call.inputs.chars == 502
    assert not from_json({"input": "x", "truncation_direction": "Right"}).call.truncate_left  # TEI's spelling


@pytest.mark.parametrize("direction", ["right", "Right", "RIGHT", "left", "Left", "LEFT", "lEfT"])
def test_the_truncation_direction_is_taken_in_any_case(direction: str) -> None:
    """TEI writes "Left", kembed's client "left", a user "LEFT" (issue 59): all one direction."""
    call = from_json({"input": "x", "truncate": True, "truncation_direction": direction}).call
    assert call.truncate_left is (direction.lower() == "left")


@pytest.mark.parametrize(
    "body", [b'{"input": ["a"]', b'{"input": ["a"]} {}', b'{"input": "\xff"}'], ids=["cut", "trailing", "not UTF-8"]
)
def test_a_truncated_or_trailing_body_is_not_json(body: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body, SERVED, LIMITS)
    assert caught.value.message.startswith("the body is not JSON: ") and "\n" not in caught.value.message


LOCATED = {
    "the input": (InvalidInput(Field.INPUT, "too big"), False, "input"),
    "a text": (InvalidInput(Field.INPUT, "92 tokens", 3), False, "input[3]"),
    "an id of a nested sequence": (InvalidInput(Field.INPUT, "outside", 1, 4), True, "input[1][4]"),
    "an id of a lone sequence": (InvalidInput(Field.INPUT, "outside", 0, 4), False, "input[4]"),
    "dimensions": (InvalidInput(Field.DIMENSIONS, "4294967296 exceeds the model's 384"), False, "dimensions"),
}


@pytest.mark.parametrize("case", LOCATED)
def test_domain_errors_name_the_jsons_path_as_param(case: str) -> None:
    error, nested, param = LOCATED[case]
    api = failed(error, nested)
    assert (api.status, api.param, api.message) == (400, param, f"{param}: {error.reason}")


@pytest.mark.parametrize(
    ("failure", "status", "kind"),
    [
        (Failure.REJECTED, 429, "rate_limit_error"),
        (Failure.DEADLINE, 504, "server_error"),
        (Failure.UNAVAILABLE, 503, "server_error"),
        (Failure.INTERNAL, 500, "server_error"),
    ],
)
def test_other_failures_have_no_param(failure: Failure, status: int, kind: str) -> None:
    api = failed(EmbedError(failure, "why", 1500 if failure is Failure.REJECTED else 0))
    assert (api.status, api.kind, api.param, api.message) == (status, kind, None, "why")
    if failure is Failure.REJECTED:
        assert api.headers == {"Retry-After": "2", "retry-after-ms": "1500"}


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_a_result_is_answered_in_openai_shape(encoding: str) -> None:
    rows = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    request = Embeddings(from_json({"input": ["a", "b"]}).call, encoding, "minilm")
    result = EmbedResult(
        rows, np.array([3, 4], dtype=np.int32), "", Timings(0, 0, 0, 0), Encoding.FLOAT32, rows.shape[1]
    )
    body = orjson.loads(openai_api.answer(request, result))
    assert (body["object"], body["model"], body["usage"]) == ("list", "minilm", {"prompt_tokens": 7, "total_tokens": 7})
    assert [item["index"] for item in body["data"]] == [0, 1]
    got = [item["embedding"] for item in body["data"]]
    if encoding == "base64":
        got = [np.frombuffer(base64.b64decode(text), dtype="<f4").tolist() for text in got]
    np.testing.assert_allclose(got, rows)
