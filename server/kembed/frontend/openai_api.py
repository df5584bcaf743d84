"""The OpenAI embeddings API on kembed's call path: its JSON in as the domain's
:class:`~kembed.frontend.call.EmbedCall`, the :class:`~kembed.frontend.call.EmbedResult` back out as
OpenAI's JSON, and every failure in OpenAI's error shape (``{"error": {"message", "type", "param",
"code"}}``) with the HTTP status peers use.

The body's fields are declared once (:data:`BODY`, and :func:`input_schema` for ``input`` under a
server's limits): the parser takes its field names and values from them, and ``/openapi.json``
(:mod:`kembed.frontend.openapi`) describes them, so the two cannot disagree.

No HTTP here (``rest.py`` serves it), so every mapping is tested without a server. Every body is
read by :class:`~kembed.frontend.json_body.Body`, whole or as its bytes arrive, which checks each
item against the limits as it comes and hands the fields it read to :func:`embeddings`. Bad input
the service finds (``InvalidInput``: the vocabulary, lengths in tokens, dimensions) is named from its
location by the JSON's own paths (``input[3]``, ``input[1][4]``), so a REST client reads the field
it sent.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from kembed.domain.errors import EmbedError, Failure, Field, InvalidInput
from kembed.domain.inputs import Sequences
from kembed.domain.prompts import INPUT_TYPES, MAX_PROMPT_CHARS, NAME_PATTERN, ModelPrompts, PromptChoice
from kembed.frontend.call import EmbedCall, EmbedResult, Limits, Texts
from kembed.frontend.chunks import Chunks
from kembed.frontend.quantize import Encoding
from kembed.policy.priority import Priority

MAX_TOKEN_ID = 2**31 - 1  # ids are int32 on the way to the model
INPUT_SHAPES = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
ITEM_SHAPES = "a string, a token id or an array of token ids"
# TEI's truncation_direction, in any case (TEI writes "Left", kembed's client "left"): whether
# truncate keeps an input's end.
DIRECTIONS = {"right": False, "left": True}
MAX_FIELD_CHARS = 1024  # a field other than input: a model name, an encoding, a user id


def _any_case(words: Iterable[str]) -> str:
    """A JSON Schema pattern that matches these words in any case (ECMA-262 has no case flag)."""
    alternatives = ("".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in w) for w in words)
    return f"^(?:{'|'.join(alternatives)})$"


@dataclass(frozen=True)
class BodyField:
    """A field of the body besides ``input``: its name, its value's JSON Schema (null is always
    taken too, as the field's absence), what it means, and whether it is kembed's extension."""

    name: str
    schema: dict[str, Any]
    description: str
    extension: bool = False
    default: Any = None


_TEXT = {"type": "string", "maxLength": MAX_FIELD_CHARS}
# The body's fields besides input: OpenAI's (what its SDK and LangChain's OpenAIEmbeddings send), then
# kembed's extensions. Any other is refused, as OpenAI refuses it: ignored, a misspelt option would be lost.
BODY = (
    BodyField("model", _TEXT, "The model served, by its id or KEMBED_SERVED_MODEL_NAME; absent: the first served"),
    BodyField(
        "encoding_format",
        {"type": "string", "enum": ["float", "base64", *(e.value for e in Encoding if e is not Encoding.FLOAT32)]},
        "float or base64 (float32's bytes); kembed's quantized kinds: each vector an array of integers",
        default="float",
    ),
    BodyField("dimensions", {"type": "integer", "minimum": 1}, "Matryoshka truncation to the first N, renormalised"),
    BodyField("user", _TEXT, "Taken and ignored"),
    BodyField("truncate", {"type": "boolean"}, "Cut an input over the model's limit instead of a 400", True, False),
    BodyField(
        "truncation_direction",
        {"type": "string", "pattern": _any_case(DIRECTIONS)},
        "Which end truncate cuts: right (its start is kept) or left (its end), in any case (TEI's Right, Left)",
        True,
        "right",
    ),
    BodyField("chunk", {"type": "boolean"}, "Embed an input over the model's limit as chunks, averaged", True),
    BodyField(
        "priority",
        {"type": "string", "enum": ["interactive", "batch"]},
        "interactive (a caller waits) or batch (an ingest, which queries go ahead of)",
        True,
        "interactive",
    ),
    BodyField(
        "prompt_name",
        {"type": "string", "pattern": f"^$|{NAME_PATTERN}"},
        "One of the model's prompts (GET /v1/models lists them); empty: none",
        True,
    ),
    BodyField("prompt", {"type": "string", "maxLength": MAX_PROMPT_CHARS}, "A prompt's text; empty: none", True),
    BodyField(
        "input_type",
        {"type": "string", "enum": ["", *INPUT_TYPES]},
        "The model's prompt for that side (query, or passage and document alike); empty: none",
        True,
    ),
)
OPENAI_FIELDS = ("input", *(f.name for f in BODY if not f.extension))
EXTENSIONS = tuple(f.name for f in BODY if f.extension)
FIELDS = frozenset(OPENAI_FIELDS + EXTENSIONS)
_ENUMS = {f.name: f.schema["enum"] for f in BODY if "enum" in f.schema}
# The encodings by the name a body gives: OpenAI's two, then the quantized ones (kembed/frontend/quantize.py).
ENCODINGS = {
    name: Encoding.FLOAT32 if name in ("float", "base64") else Encoding(name) for name in _ENUMS["encoding_format"]
}
PRIORITIES = {name: Priority.INTERACTIVE if name == "interactive" else Priority.BATCH for name in _ENUMS["priority"]}


def input_schema(limits: Limits) -> dict[str, Any]:
    """``input``'s JSON Schema under ``limits``: what :class:`Body` takes. A text's characters are
    not bounded here: over the limit, truncate cuts it, and without truncate it is a 400 naming it."""
    text = {"type": "string", "minLength": 1}
    ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
        "minItems": 1,
        "maxItems": limits.max_text_chars,
    }
    many = {"minItems": 1, "maxItems": limits.max_items}
    return {
        "description": f"{INPUT_SHAPES} (the model's token ids, special tokens included); at most "
        f"{limits.max_text_chars} characters a text, else a 400 naming it, or with truncate cut to them",
        "oneOf": [text, {"type": "array", "items": text, **many}, ids, {"type": "array", "items": ids, **many}],
    }


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

    @classmethod
    def invalid(cls, status: int, message: str, code: str | None = None) -> ApiError:
        """The request, not one of its fields, is at fault (its route, head or transport)."""
        return cls(status, message, "invalid_request_error", None, code)

    @classmethod
    def internal(cls) -> ApiError:
        """A bug: the client learns nothing of it but that it was ours."""
        return cls(500, "internal error", "server_error", None, "internal_error")

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return orjson.dumps({"error": error})


def invalid(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "invalid_value")


@dataclass(frozen=True, slots=True)
class Embeddings:
    """One parsed ``POST /v1/embeddings``: the call, and how its answer is written."""

    call: EmbedCall
    encoding: str  # encoding_format: "float", "base64" (float32's bytes) or a quantized one
    model: str  # the name the answer carries
    nested: bool = False  # token ids came as an array of arrays: an id is named input[i][j], else input[j]


def embeddings(
    fields: dict[str, Any],
    inputs: Texts | Sequences,
    nested: bool,
    served: tuple[str, ...],
    peer: str,
    timeout_s: float | None,
) -> Embeddings:
    """The fields other than input, checked, around the inputs read. A field that is null is absent:
    one rule for every optional field, as clients that write each option (null when unset) expect."""
    fields = {name: value for name, value in fields.items() if value is not None}
    model = fields.get("model", served[0])
    if not isinstance(model, str):
        raise invalid("model: must be a string", "model")
    if model not in served:
        message = f"model: {model!r} is not served here (served: {', '.join(served)})"
        raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")
    encoding = fields.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise invalid(f"encoding_format: {encoding!r} is not one of {', '.join(ENCODINGS)}", "encoding_format")
    truncate, priority = _flag(fields, "truncate"), _priority(fields)
    dimensions = fields.get("dimensions", 0)
    if "dimensions" in fields and (not _is_int(dimensions) or dimensions < 1):
        raise invalid("dimensions: must be a whole number of at least 1", "dimensions")
    call = EmbedCall(
        inputs=inputs,
        truncate=truncate,
        truncate_left=truncates_left(fields),
        chunk=_flag(fields, "chunk") if "chunk" in fields else None,
        dimensions=dimensions,
        encoding=ENCODINGS[encoding],
        priority=priority,
        prompt=_prompt(fields),
        timeout_s=timeout_s,
        peer=peer,
    )
    return Embeddings(call, encoding, model, nested)


def answer(request: Embeddings, result: EmbedResult) -> bytes:
    """The result as OpenAI's JSON: one object per input, in order, and the token usage."""
    vectors = result.embeddings
    if request.encoding == "base64":  # the little-endian float32 buffer: what the official client decodes
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode() for row in vectors.astype("<f4", copy=False)]
    else:
        embeddings = list(vectors)  # orjson writes each row natively, float32 or quantized integers
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


def tokens(request: Embeddings, chunks: Chunks) -> bytes:
    """``POST /tokenize``: each input's token ids as an embedding call computes them (its prompt,
    truncation, and chunks: one list of ids per chunk), and the usage that call would report."""
    seqs, firsts = chunks.seqs, np.cumsum(chunks.counts) - chunks.counts
    ids = [seqs.ids[start : start + length] for start, length in zip(seqs.offsets, seqs.lengths, strict=True)]
    counts = chunks.token_counts()
    total = int(counts.sum())
    data = [
        {"object": "tokens", "index": i, "tokens": ids[first : first + n], "count": int(counts[i])}
        for i, (first, n) in enumerate(zip(firsts, chunks.counts, strict=True))
    ]
    usage = {"prompt_tokens": total, "total_tokens": total}
    return orjson.dumps(
        {"object": "list", "data": data, "model": request.model, "usage": usage}, option=orjson.OPT_SERIALIZE_NUMPY
    )


def models(served: tuple[str, ...], created: int, prompts: ModelPrompts) -> bytes:
    """``GET /v1/models``: every name this server answers to, with the model's prompts (kembed's
    fields beside OpenAI's)."""
    default = prompts.default_name or None
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kembed",
            "prompts": prompts.prompts,
            "default_prompt_name": default,
        }
        for name in served
    ]
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


def _priority(data: dict[str, Any]) -> Priority:
    """kembed's extension ``priority``: ``interactive`` (the default: queries) or ``batch`` (ingest)."""
    value = data.get("priority", "interactive")
    if not isinstance(value, str) or value not in PRIORITIES:
        raise invalid(f"priority: {value!r} is not one of {', '.join(PRIORITIES)}", "priority")
    return PRIORITIES[value]


def _prompt(data: dict[str, Any]) -> PromptChoice:
    """kembed's extensions ``prompt_name``, ``prompt`` and ``input_type``: strings."""
    name, text, input_type = (data.get(key) for key in ("prompt_name", "prompt", "input_type"))
    for key, value in (("prompt_name", name), ("prompt", text), ("input_type", input_type)):
        if value is not None and not isinstance(value, str):
            raise invalid(f"{key}: must be a string", key)
    return PromptChoice(name or "", text, input_type or "")


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise invalid(f"{name}: must be true or false", name)
    return value


def truncates_left(fields: dict[str, Any]) -> bool:
    """kembed's extension ``truncation_direction``, TEI's: ``right`` (the default: truncate keeps an
    input's start) or ``left`` (its end)."""
    value = fields.get("truncation_direction")
    if value is None:
        return False
    if not isinstance(value, str) or value.lower() not in DIRECTIONS:
        raise invalid(f"truncation_direction: {value!r} is not right or left (in any case)", "truncation_direction")
    return DIRECTIONS[value.lower()]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
