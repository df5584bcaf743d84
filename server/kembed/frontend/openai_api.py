"""The OpenAI embeddings API on kembed's call path: its JSON in as the domain's
:class:`~kembed.frontend.call.EmbedCall`, the :class:`~kembed.frontend.call.EmbedResult` back out as
OpenAI's JSON, and every failure in OpenAI's error shape (``{"error": {"message", "type", "param",
"code"}}``) with the HTTP status peers use.

Pure (no HTTP here: ``rest.py`` serves it), so every mapping is tested without a server. The walk
over the parsed JSON is the one place REST input meets the limits: each list's length before its
items are looked at, each text's characters, each id's range, no empty item. Bad input the service
finds (``InvalidInput``: the vocabulary, lengths in tokens, dimensions) is named from its location
by the JSON's own paths (``input[3]``, ``input[1][4]``), so a REST client reads the field it sent.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import orjson

from kembed.errors import EmbedError, Failure, Field, InvalidInput
from kembed.frontend.call import EmbedCall, EmbedResult, Limits, Texts
from kembed.inputs import Sequences
from kembed.priority import Priority

ENCODINGS = ("float", "base64")
PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}
MAX_TOKEN_ID = 2**31 - 1  # ids are int32 on the way to the model
INPUT_SHAPES = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"


class ApiError(Exception):
    """A failure with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind  # OpenAI's error "type"
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return orjson.dumps({"error": error})


def invalid(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "invalid_value")


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One parsed ``POST /v1/embeddings``: the call, and how its answer is written."""

    call: EmbedCall
    encoding: str  # "float" or "base64"
    model: str  # the name the answer carries
    nested: bool = False  # token ids came as an array of arrays: an id is named input[i][j], else input[j]


def parse(body: bytes, served: tuple[str, ...], limits: Limits, peer: str = "") -> Embeddings:
    """The body, loaded and mapped by :func:`from_json`."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise invalid(f"the body is not JSON: {error}", None) from None
    return from_json(data, served, limits, peer)


def from_json(data: Any, served: tuple[str, ...], limits: Limits, peer: str = "") -> Embeddings:
    """The request, checked field by field; ``served`` are the model names this server answers to
    (the first is the one answers carry when the request names none); ``peer`` the caller's
    connection. Raises :class:`ApiError`, or :class:`InvalidInput` for :func:`failed` to name."""
    if not isinstance(data, dict):
        raise invalid("the body must be a JSON object", None)
    model = data.get("model", served[0])
    if not isinstance(model, str):
        raise invalid("model: must be a string", "model")
    if model not in served:
        message = f"model: {model!r} is not served here (served: {', '.join(served)})"
        raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")
    encoding = data.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise invalid(f"encoding_format: {encoding!r} is not one of {', '.join(ENCODINGS)}", "encoding_format")
    truncate, priority = _flag(data, "truncate"), _priority(data)
    dimensions = data.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise invalid("dimensions: must be a whole number of at least 1", "dimensions")
    if "input" not in data:
        raise invalid("input: missing", "input")
    inputs, nested = _inputs(data["input"], limits, truncate)
    call = EmbedCall(inputs=inputs, truncate=truncate, dimensions=dimensions or 0, priority=priority, peer=peer)
    return Embeddings(call, encoding, model, nested)


def answer(request: Embeddings, result: EmbedResult) -> bytes:
    """The result as OpenAI's JSON: one object per input, in order, and the token usage."""
    vectors = result.embeddings
    if request.encoding == "base64":  # the little-endian float32 buffer: what the official client decodes
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode() for row in vectors.astype("<f4", copy=False)]
    else:
        embeddings = list(vectors)  # orjson writes each float32 row natively
    tokens = int(result.token_counts.sum())
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "model": request.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def models(served: tuple[str, ...], created: int) -> bytes:
    """``GET /v1/models``: every name this server answers to."""
    data = [{"id": name, "object": "model", "created": created, "owned_by": "kembed"} for name in served]
    return orjson.dumps({"object": "list", "data": data})


_STATUS = {
    Failure.REJECTED: (429, "rate_limit_error", "server_overloaded"),
    Failure.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    Failure.INTERNAL: (500, "server_error", "internal_error"),
    Failure.DEADLINE: (504, "server_error", "timeout"),
    Failure.UNAVAILABLE: (503, "server_error", "unavailable"),
}


def failed(error: EmbedError, nested: bool = False) -> ApiError:
    """A domain failure as the OpenAI error a client expects; bad input named by the JSON's paths
    (``nested``: the request's token ids came as an array of arrays)."""
    status, kind, code = _STATUS[error.failure]
    if isinstance(error, InvalidInput):
        param = _param(error, nested)
        api = ApiError(status, f"{param}: {error.reason}", kind, param, code)
    else:
        api = ApiError(status, error.message, kind, None, code)
    if error.retry_after_ms:
        api.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
        api.headers["retry-after-ms"] = str(error.retry_after_ms)  # the official client reads it first
    return api


def _param(error: InvalidInput, nested: bool) -> str:
    """``input``, ``input[3]``; a token id ``input[1][4]``, or ``input[4]`` in a lone array of ids."""
    if error.field is not Field.INPUT:
        return str(error.field)
    if error.index is None:
        return "input"
    if error.position is None:
        return f"input[{error.index}]"
    return f"input[{error.index}][{error.position}]" if nested else f"input[{error.position}]"


def _inputs(value: Any, limits: Limits, truncate: bool) -> tuple[Texts | Sequences, bool]:
    """Texts, or token-id sequences (the pre-tokenized path), and whether the ids came as an array
    of arrays; decided by the first item, each list's length checked before its items are read."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(f"input: must be {INPUT_SHAPES}, not empty", "input")
    if isinstance(value[0], list):
        return _sequences(value, limits), True
    if _is_int(value[0]):
        return _sequences([value], limits), False
    limits.check_count(len(value))
    if not all(isinstance(item, str) for item in value):
        raise invalid(f"input: must be {INPUT_SHAPES}", "input")
    empty = next((i for i, text in enumerate(value) if not text), None)
    if empty is not None:
        raise invalid(f"input[{empty}]: an empty string", f"input[{empty}]")
    return limits.texts(value, truncate), False


def _sequences(sequences: list[Any], limits: Limits) -> Sequences:
    limits.check_count(len(sequences))
    lengths = np.empty(len(sequences), dtype=np.int32)
    for i, sequence in enumerate(sequences):
        if not isinstance(sequence, list):
            raise invalid(f"input: must be {INPUT_SHAPES}", "input")
        if not sequence:
            raise invalid(f"input[{i}]: an empty array of token ids", f"input[{i}]")
        lengths[i] = len(sequence)
    if not all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in chain.from_iterable(sequences)):
        raise invalid(f"input: token ids must be whole numbers from 0 to {MAX_TOKEN_ID}", "input")
    ids = np.fromiter(chain.from_iterable(sequences), dtype=np.int32, count=int(lengths.sum()))
    return Sequences(ids=ids, lengths=lengths)


def _priority(data: dict[str, Any]) -> Priority:
    """kembed's extension ``priority``: ``interactive`` (the default: queries) or ``batch`` (ingest)."""
    value = data.get("priority", "interactive")
    if not isinstance(value, str) or value not in PRIORITIES:
        raise invalid(f"priority: {value!r} is not one of {', '.join(PRIORITIES)}", "priority")
    return PRIORITIES[value]


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise invalid(f"{name}: must be true or false", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
