"""The OpenAI embeddings API on kembed's request path: its JSON in, the proto's ``EmbedRequest`` to the
service, the ``EmbedResponse`` back out as OpenAI's JSON, and every failure in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status peers use.

Pure (no HTTP here: ``rest.py`` serves it), so every mapping is tested without a server. The
service checks what it checks for gRPC too (lengths, the vocabulary, dimensions...); its messages
name the proto's fields (``texts[3]``, ``tokens.ids[12]``), which this module renames to the JSON's
(``input[3]``, ``input[1][4]``), so a REST client reads the field it sent.
"""

from __future__ import annotations

import base64
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from kembed.errors import EmbedError, Failure
from kembed.v1 import embedder_pb2 as pb

ENCODINGS = ("float", "base64")
PRIORITIES: dict[str, pb.Priority] = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32
INPUT_SHAPES = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
_FIELD = re.compile(r"^(texts|tokens\.ids|tokens\.lengths|texts, tokens)(?:\[(\d+)\])?: ")


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


@dataclass(frozen=True)
class Call:
    """One parsed ``POST /v1/embeddings``."""

    request: pb.EmbedRequest
    encoding: str  # "float" or "base64"
    model: str  # the name the answer carries
    lengths: tuple[int, ...] = ()  # of token-id sequences, to name an id's position in errors
    nested: bool = False  # the ids came as an array of arrays


def parse(body: bytes, served: tuple[str, ...]) -> Call:
    """The request, checked field by field; ``served`` are the model names this server answers to
    (the first is the one answers carry when the request names none)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise invalid(f"the body is not JSON: {error}", None) from None
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
    request = pb.EmbedRequest(truncate=_flag(data, "truncate"), priority=_priority(data))
    dimensions = data.get("dimensions")
    if dimensions is not None:
        if not _is_int(dimensions) or dimensions < 1:
            raise invalid("dimensions: must be a whole number of at least 1", "dimensions")
        request.dimensions = dimensions
    if "input" not in data:
        raise invalid("input: missing", "input")
    lengths, nested = _put_input(request, data["input"])
    return Call(request, encoding, model, lengths, nested)


def answer(call: Call, response: pb.EmbedResponse) -> bytes:
    """The service's answer as OpenAI's JSON: one object per input, in order, and the token usage."""
    vectors = np.frombuffer(response.embeddings, dtype="<f4").reshape(response.count, response.dimensions)
    if call.encoding == "base64":  # the float32 buffer as it is: what the official client decodes
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode() for row in vectors]
    else:
        embeddings = list(vectors)  # orjson writes each float32 row natively
    tokens = int(sum(response.token_counts))
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "model": call.model,
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


def failed(error: EmbedError, call: Call | None = None) -> ApiError:
    """A domain failure as the OpenAI error a client expects, its fields renamed to the JSON's."""
    status, kind, code = _STATUS[error.failure]
    message, param = _renamed(error.message, call)
    api = ApiError(status, message, kind, param if error.failure is Failure.INVALID_ARGUMENT else None, code)
    if error.retry_after_ms:
        api.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
        api.headers["retry-after-ms"] = str(error.retry_after_ms)  # the official client reads it first
    return api


def _renamed(message: str, call: Call | None) -> tuple[str, str | None]:
    """``texts[3]: ...`` → ``input[3]: ...``; a flat id index → ``input[i][j]``."""
    found = _FIELD.match(message)
    if found is None:
        field = message.split(":", 1)[0]
        return message, field if field.isidentifier() else None
    name, index = found.group(1), found.group(2)
    if name == "tokens.ids" and index is not None and call is not None and call.lengths:
        ends = np.cumsum(call.lengths)
        sequence = int(np.searchsorted(ends, int(index), side="right"))
        position = int(index) - (int(ends[sequence - 1]) if sequence else 0)
        param = f"input[{sequence}][{position}]" if call.nested else f"input[{position}]"
    else:
        param = "input" if index is None else f"input[{index}]"
    return param + ": " + message[found.end() :], param


def _put_input(request: pb.EmbedRequest, value: Any) -> tuple[tuple[int, ...], bool]:
    """Texts, or token-id sequences (the pre-tokenized path); the sequences' lengths, and whether
    they came as an array of arrays."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(f"input: must be {INPUT_SHAPES}, not empty", "input")
    if all(isinstance(item, str) for item in value):
        empty = next((i for i, text in enumerate(value) if not text), None)
        if empty is not None:
            raise invalid(f"input[{empty}]: an empty string", f"input[{empty}]")
        request.texts.extend(value)
        return (), False
    nested = all(isinstance(item, list) for item in value)
    if not nested and not all(_is_int(item) for item in value):
        raise invalid(f"input: must be {INPUT_SHAPES}", "input")
    return _put_tokens(request, value if nested else [value]), nested


def _put_tokens(request: pb.EmbedRequest, sequences: list[list[Any]]) -> tuple[int, ...]:
    lengths = tuple(len(sequence) for sequence in sequences)
    empty = next((i for i, n in enumerate(lengths) if n == 0), None)
    if empty is not None:
        raise invalid(f"input[{empty}]: an empty array of token ids", f"input[{empty}]")
    flat = list(itertools.chain.from_iterable(sequences))
    ids = np.asarray(flat) if all(_is_int(i) for i in flat) else None
    if ids is None or ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() > MAX_TOKEN_ID)):
        raise invalid("input: token ids must be whole numbers from 0 to 2147483647", "input")
    request.tokens.ids = ids.astype("<i4").tobytes()
    request.tokens.lengths.extend(lengths)
    return lengths


def _priority(data: dict[str, Any]) -> pb.Priority:
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
