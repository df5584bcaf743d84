"""What every candidate stack answers through: the limits, ``POST /v1/embeddings`` parsed and
checked field by field (orjson), and the OpenAI-shaped reply of one precomputed embedding per text."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from bench.tools import echo

HOST = "127.0.0.1"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
JSON = "application/json"
# Precomputed, and not zeros: orjson writes every one of these floats on each call, as kembed will.
EMBEDDING = np.linspace(-1.0, 1.0, echo.DIMENSIONS, dtype=np.float32)
EMBEDDING_BASE64 = base64.b64encode(EMBEDDING.tobytes()).decode()
TOKENS_PER_TEXT = 16  # what the echo reports per text
MODEL_ID = "minilm"
BACKLOG = 1024

Stop = Callable[[], Awaitable[None]]  # stops the stack gracefully: stop accepting, finish what is in flight


@dataclass(frozen=True)
class Limits:
    """Every stack gets these where it can enforce them."""

    max_body_bytes: int = 1 << 20  # larger bodies: 413
    idle_s: float = 5.0  # a keep-alive connection with no request open is closed after this
    request_s: float = 10.0  # a request must arrive whole within this from its first byte (slowloris)
    drain_s: float = 10.0  # on stop, requests in flight may take this long to finish


class BadRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class EmbeddingsCall:
    texts: int
    model: str
    base64: bool
    delay_s: float  # bench only: the reply waits this long (to keep a request in flight)


def parse(body: bytes) -> EmbeddingsCall:
    """The OpenAI request fields kembed reads, each checked; ``BadRequest`` names the field."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadRequest("body", f"not JSON ({error})") from None
    if not isinstance(doc, dict):
        raise BadRequest("body", "must be a JSON object")
    texts = doc.get("input")
    if isinstance(texts, str):
        count = 1
    elif isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
        count = len(texts)
    else:
        raise BadRequest("input", "must be a string or a non-empty list of strings")
    model = doc.get("model")
    if not isinstance(model, str):
        raise BadRequest("model", "must be a string")
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest("encoding_format", "must be 'float' or 'base64'")
    delay = doc.get("delay_s", 0.0)
    if not isinstance(delay, int | float) or not 0 <= delay <= 60:
        raise BadRequest("delay_s", "must be a number of seconds from 0 to 60")
    return EmbeddingsCall(count, model, encoding == "base64", float(delay))


def render(call: EmbeddingsCall) -> bytes:
    """The OpenAI-shaped reply: one embedding per text, float32 as floats or as base64 of its bytes."""
    vector: Any = EMBEDDING_BASE64 if call.base64 else EMBEDDING
    data = [{"object": "embedding", "index": i, "embedding": vector} for i in range(call.texts)]
    tokens = TOKENS_PER_TEXT * call.texts
    reply = {"object": "list", "data": data, "model": call.model,
             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
    return orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY)


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> bytes:
    """OpenAI's error shape."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}})


async def reply_to(call: EmbeddingsCall) -> bytes:
    """Where kembed will await its engine; here only the bench's optional delay."""
    if call.delay_s:
        await asyncio.sleep(call.delay_s)
    return render(call)


async def answer(body: bytes) -> tuple[int, bytes]:
    """Status and JSON body for ``POST /v1/embeddings``."""
    try:
        call = parse(body)
    except BadRequest as error:
        return 400, error_body(str(error), error.field)
    return 200, await reply_to(call)


MODELS_BODY = orjson.dumps({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "kembed"}]})
TOO_LARGE = error_body("request body too large", None)
