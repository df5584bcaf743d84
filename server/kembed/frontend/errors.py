"""A request's failure, as the gRPC status it is answered with."""

from __future__ import annotations

import grpc


class EmbedError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

    @classmethod
    def named(cls, code: str, message: str, retry_after_ms: int = 0) -> EmbedError:
        """From a status code's name, as the engine sends it."""
        return cls(grpc.StatusCode[code], message, retry_after_ms)
