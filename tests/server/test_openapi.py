"""``/openapi.json`` and ``/docs``, built from what the REST parser reads (kembed.frontend.openapi):
a valid OpenAPI 3.1 document that describes every route the REST edge serves and every field the
parser takes, under this server's limits; the parser takes what the schema allows and refuses what
it does not; the real answers and refusals have the shapes it says; the page loads nothing. Served
by a real server: test_rest."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from kembed.config.settings import Settings
from kembed.domain.errors import EmbedError, Failure
from kembed.domain.inputs import Sequences
from kembed.domain.prompts import ModelPrompts
from kembed.frontend import openai_api, rest
from kembed.frontend.call import EmbedResult, Limits, Timings
from kembed.frontend.chunks import Chunks
from kembed.frontend.json_body import parse
from kembed.frontend.openai_api import BODY, FIELDS, ApiError, Embeddings, failed
from kembed.frontend.openapi import body_schema, document, page
from kembed.frontend.quantize import Encoding

SETTINGS = Settings.from_env({}, max_items_per_request=8, max_text_chars=500)
LIMITS = Limits.of(SETTINGS)
SERVED = ("minilm",)
BODY_SCHEMA = Draft202012Validator(body_schema(LIMITS))


def schema_of(name: str) -> Draft202012Validator:
    return Draft202012Validator(document(SETTINGS, keys=False)["components"]["schemas"][name])


def parsed(data: Any) -> Embeddings | ApiError:
    try:
        return parse(orjson.dumps(data), SERVED, LIMITS)
    except ApiError as error:
        return error
    except EmbedError as error:
        return failed(error)


@pytest.mark.parametrize("keys", [False, True], ids=["open", "with keys"])
def test_the_document_is_valid_openapi(keys: bool) -> None:
    doc = document(SETTINGS, keys)
    validate(doc)  # raises, naming what is wrong
    assert doc["openapi"].startswith("3.1")


def test_it_describes_every_route_the_rest_edge_serves_and_no_other() -> None:
    doc = document(SETTINGS, keys=False)
    described = {path: next(iter(item)).upper() for path, item in doc["paths"].items()}
    assert described == rest.METHODS


def test_with_keys_every_route_but_the_description_needs_one() -> None:
    doc = document(SETTINGS, keys=True)
    needs = {path: bool(item[next(iter(item))]["security"]) for path, item in doc["paths"].items()}
    assert needs == {path: path not in rest.PUBLIC for path in rest.METHODS}
    assert {"/openapi.json", "/docs"} == rest.PUBLIC
    assert doc["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}


def test_the_body_holds_the_fields_the_parser_takes_and_no_other() -> None:
    schema = body_schema(LIMITS)
    assert set(schema["properties"]) == FIELDS
    assert schema["required"] == ["input"] and schema["additionalProperties"] is False
    assert BODY_SCHEMA.is_valid({"input": "x", "promt": "p"}) is False
    assert isinstance(parsed({"input": "x", "promt": "p"}), ApiError)


def test_the_limits_are_the_servers() -> None:
    shapes = body_schema(LIMITS)["properties"]["input"]["oneOf"]
    assert [shape.get("maxItems") for shape in shapes] == [None, 8, 500, 8]
    assert "500 characters" in body_schema(LIMITS)["properties"]["input"]["description"]


def allowed_values() -> list[tuple[str, Any]]:
    """Every value an enum of the body allows, and the direction in the cases TEI and users write."""
    values = [(f.name, v) for f in BODY for v in f.schema.get("enum", [])]
    return values + [("truncation_direction", v) for v in ("right", "left", "Right", "Left", "LEFT", "rIgHt")]


@pytest.mark.parametrize(("name", "value"), allowed_values())
def test_every_value_the_schema_allows_the_parser_takes(name: str, value: Any) -> None:
    body = {"input": ["some text"], name: value}
    assert BODY_SCHEMA.is_valid(body)
    assert isinstance(parsed(body), Embeddings), parsed(body)


BODIES: dict[str, tuple[Any, bool]] = {
    "a text": ({"input": "x"}, True),
    "texts and every option null": ({"input": ["a", "b"], **{f.name: None for f in BODY}}, True),
    "ids": ({"input": [101, 7592, 102], "dimensions": 64}, True),
    "arrays of ids": ({"input": [[101, 102], [101, 7, 102]]}, True),
    "a prompt name": ({"input": "x", "prompt_name": "query"}, True),
    "no input": ({"model": "minilm"}, False),
    "an empty input": ({"input": []}, False),
    "an empty text": ({"input": ["a", ""]}, False),
    "null among texts": ({"input": ["a", None]}, False),
    "too many texts": ({"input": ["a"] * 9}, False),
    "a negative id": ({"input": [[101, -1]]}, False),
    "an id past int32": ({"input": [101, 2**31]}, False),
    "a sequence too long": ({"input": [[1] * 501]}, False),
    "a mixed input": ({"input": ["a", 1]}, False),
    "dimensions 0": ({"input": "x", "dimensions": 0}, False),
    "an unknown encoding": ({"input": "x", "encoding_format": "hex"}, False),
    "an unknown direction": ({"input": "x", "truncation_direction": "up"}, False),
    "a priority number": ({"input": "x", "priority": 1}, False),
    "a bad prompt name": ({"input": "x", "prompt_name": "a b"}, False),
    "an unknown input type": ({"input": "x", "input_type": "questions"}, False),
    "a long user": ({"input": "x", "user": "u" * 1025}, False),
    "a long prompt": ({"input": "x", "prompt": "p" * 1025}, False),
}


@pytest.mark.parametrize("case", BODIES)
def test_the_schema_and_the_parser_agree_on_a_body(case: str) -> None:
    body, taken = BODIES[case]
    assert BODY_SCHEMA.is_valid(body) is taken
    outcome = parsed(body)
    if isinstance(outcome, Embeddings):  # what the service checks (a prompt's name, the input type) next
        try:
            outcome.call.prompt.check()
        except EmbedError as error:
            outcome = failed(error)
    assert isinstance(outcome, Embeddings) is taken, outcome


@pytest.mark.parametrize("encoding", ["float", "base64", "int8", "ubinary"])
def test_an_answer_has_the_shape_described(encoding: str) -> None:
    call = parse(orjson.dumps({"input": ["a", "b"]}), SERVED, LIMITS).call
    rows = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    encoded = Encoding.FLOAT32 if encoding in ("float", "base64") else Encoding(encoding)
    result = EmbedResult(
        rows if encoded is Encoding.FLOAT32 else np.array([[76, 102], [127, 0]], dtype=np.int8),
        np.array([3, 4], dtype=np.int32),
        "",
        Timings(0, 0, 0, 0),
        encoded,
        2,
    )
    schema_of("Embeddings").validate(orjson.loads(openai_api.answer(Embeddings(call, encoding, "minilm"), result)))


def test_tokens_models_and_errors_have_the_shapes_described() -> None:
    request = Embeddings(parse(b'{"input": ["a", "b"]}', SERVED, LIMITS).call, "float", "minilm")
    seqs = Sequences(ids=np.array([101, 7, 102, 101, 102], dtype=np.int32), lengths=np.array([3, 2], dtype=np.int32))
    schema_of("Tokens").validate(orjson.loads(openai_api.tokens(request, Chunks.whole(seqs))))
    prompts = ModelPrompts({"query": "query: "}, "query")
    schema_of("Models").validate(orjson.loads(openai_api.models(("minilm", "other"), 1, prompts)))
    for error in (parsed({"input": ["a", None]}), failed(EmbedError(Failure.REJECTED, "busy", 100))):
        assert isinstance(error, ApiError)
        schema_of("Error").validate(orjson.loads(error.body()))


def test_the_page_loads_nothing_and_shows_every_route_and_field() -> None:
    text = page(document(SETTINGS, keys=True))
    assert "<script" not in text and "src=" not in text and "http://" not in text and "https://" not in text
    assert "@import" not in text and "url(" not in text
    for path in rest.METHODS:
        assert f"<code>{path}</code>" in text
    for name in FIELDS:
        assert f"<code>{name}</code>" in text
