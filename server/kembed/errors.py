"""What can go wrong with a request, whatever carries it: the front ends and the engine raise these,
and each edge maps them to its own transport's codes (``frontend/grpc_api.py``: gRPC status codes)."""

from __future__ import annotations

from enum import IntEnum


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
