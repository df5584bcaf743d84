"""The client's one error family: what a caller catches, whatever went wrong.

:class:`EmbedError` carries the status code, the server's message (one line, a text's index counted
in the caller's whole list) and, for a refusal, the pushback; never a gRPC call object. It is also a
``grpc.RpcError`` (``code()``, ``details()``), so code written against the plain stub still catches it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import cast

import grpc

from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.domain.texts import why_not

_TEXT_INDEX = re.compile(r"^texts\[(\d+)\]")


class EmbedError(grpc.RpcError):
    """A call that failed: ``code()`` the gRPC status, ``message`` what the server (or the client's
    own check) said, ``retry_after_s`` the server's pushback when it gave one."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        self.status = code
        self.message = message
        self.retry_after_s = retry_after_s
        super().__init__(str(self))

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.message

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message}"


class InvalidInput(EmbedError, ValueError):
    """The texts or the options are not what the server takes (INVALID_ARGUMENT): sending them
    again cannot help. Raised before sending for what the client can see itself."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


class Refused(EmbedError):
    """The server is overloaded (RESOURCE_EXHAUSTED) beyond what the retries and the deadline allow."""


class Unavailable(EmbedError):
    """The server could not be reached or did not answer in time (UNAVAILABLE, DEADLINE_EXCEEDED)."""


KINDS: dict[grpc.StatusCode, type[EmbedError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Refused,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


def embed_error(error: grpc.RpcError, first: int = 0) -> EmbedError:
    """``error`` as the caller sees it: a text's index counted from ``first``, the message on one line."""
    if isinstance(error, EmbedError):
        return error
    if not isinstance(error, grpc.Call | grpc.aio.AioRpcError):  # a bare RpcError: nothing to read
        return EmbedError(grpc.StatusCode.UNKNOWN, str(error))
    code, details = error.code(), " ".join((error.details() or "").split())
    message = _TEXT_INDEX.sub(lambda m: f"texts[{int(m[1]) + first}]", details)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidInput(message)
    return KINDS.get(code, EmbedError)(code, message, pushback_s(error))


def pushback_s(error: grpc.Call | grpc.aio.AioRpcError) -> float | None:
    """The server's ``grpc-retry-pushback-ms``, in seconds (None: it gave none)."""
    trailers = cast(Iterable[tuple[str, str]], error.trailing_metadata() or ())
    pushback = dict(trailers).get(RETRY_PUSHBACK_KEY)
    return None if pushback is None else int(pushback) / 1000


def check_texts(texts: Sequence[str]) -> None:
    """What the client can refuse before sending, naming the text (as OpenAI's edge does)."""
    if isinstance(texts, str):
        raise InvalidInput("texts: a list of strings, not one string")
    if not texts:
        raise InvalidInput("texts: an empty list: nothing to embed")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInput(f"texts[{index}]: {text!r:.40} is not a str")
        if (why := why_not(text)) is not None:
            raise InvalidInput(f"texts[{index}]: {why}")
