"""What can go wrong with a request, whatever carries it: the front ends and the engine raise these,
and each edge maps them to its own transport's codes (``frontend/grpc_messages.py``: gRPC status codes,
``frontend/openai_api.py``: HTTP statuses in OpenAI's error shape)."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Failure(IntEnum):
    """Why a request was not answered with embeddings. The values cross the front end/engine link."""

    REJECTED = 1  # admission control: the server is overloaded, come back after retry_after_ms
    INVALID_ARGUMENT = 2  # bad input: the message names the field
    INTERNAL = 3  # the model failed on this request's items alone
    DEADLINE = 4  # the deadline passed before the request was computed
    UNAVAILABLE = 5  # warming up or draining: try again, or another replica


class EmbedError(Exception):
    def __init__(self, failure: Failure, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message
        self.retry_after_ms = retry_after_ms


class Field(StrEnum):
    """A call's fields that input can be wrong in, by their domain names (each edge has its own)."""

    INPUT = "input"  # the inputs as a whole, one item of them, or one token id of an item
    DIMENSIONS = "dimensions"
    REQUEST_ID = "request_id"
    CHUNK = "chunk"
    PROMPT_NAME = "prompt_name"
    PROMPT = "prompt"
    INPUT_TYPE = "input_type"
    ENCODING = "encoding"


class InvalidInput(EmbedError):
    """Bad input, located as data: the ``field``, the item ``index`` within it, and the ``position``
    of a token id within that item. Each edge names the place in its own wire format (``texts[3]``,
    ``tokens.ids[12]``, ``input[1][4]``) and adds the ``reason``."""

    def __init__(self, field: Field, reason: str, index: int | None = None, position: int | None = None) -> None:
        where = "".join(f"[{i}]" for i in (index, position) if i is not None)
        super().__init__(Failure.INVALID_ARGUMENT, f"{field}{where}: {reason}")
        self.field = field
        self.reason = reason
        self.index = index
        self.position = position
