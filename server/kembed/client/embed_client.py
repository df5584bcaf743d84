"""The library: texts in, a numpy array out, overload handled politely.

RESOURCE_EXHAUSTED is retried after the server's ``grpc-retry-pushback-ms`` (with jitter), and
UNAVAILABLE (warming up, draining, a replica going away) with exponential backoff, both bounded.
Retries are throttled as gRPC's ``retryThrottling`` does (:class:`RetryBudget`): while most calls
fail, a client stops retrying, so a fleet of clients sheds load before it reaches the server.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

import grpc
import numpy as np

from kembed.client.connection import MAX_MESSAGE_BYTES, Connection
from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class RetryBudget:
    """gRPC's retry throttling (gRFC A6, ``retryThrottling``): a token count that each failed
    attempt lowers by 1 and each answered one raises by ``token_ratio``, up to ``max_tokens``.
    Retries go only while it is above half of ``max_tokens``: at the defaults, once more than about
    one attempt in eleven fails, retries stop until answers bring the count back up."""

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1) -> None:
        self._max = max_tokens
        self._ratio = token_ratio
        self.tokens = max_tokens

    def answered(self) -> None:
        self.tokens = min(self._max, self.tokens + self._ratio)

    def failed(self) -> None:
        self.tokens = max(0.0, self.tokens - 1)

    def may_retry(self) -> bool:
        return self.tokens > self._max / 2


class EmbedClient:
    """``EmbedClient("host:50051")``, or ``EmbedClient(Connection(...))``; the keyword arguments
    ``ca_file``, ``cert_file``, ``key_file``, ``round_robin`` and ``max_message_bytes`` build the
    :class:`Connection` for a target given as a string."""

    def __init__(
        self,
        target: str | Connection,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 6,
        backoff_s: float = 0.1,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        round_robin: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        retry_budget: RetryBudget | None = None,
    ) -> None:
        if isinstance(target, str):
            target = Connection(target, ca_file, cert_file, key_file, max_message_bytes, round_robin)
        self.connection = target
        self._channel = target.channel()
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self._timeout = timeout_s
        self._max_attempts = max_attempts
        self._backoff = backoff_s
        self._sleep = sleep
        self.retry_budget = retry_budget or RetryBudget()
        self.retries = 0  # how many attempts were retried, for callers that want to know

    def embed(
        self, texts: Sequence[str], *, normalize: bool = True, dimensions: int = 0, truncate: bool = False
    ) -> np.ndarray:
        request = pb.EmbedRequest(texts=texts, normalize=normalize, dimensions=dimensions, truncate=truncate)
        return decode(self.embed_request(request))

    def embed_tokens(
        self, sequences: Sequence[Sequence[int]], *, normalize: bool = True, dimensions: int = 0
    ) -> np.ndarray:
        """Pre-tokenized input (ids including the model's special tokens)."""
        ids = np.concatenate([np.asarray(seq, dtype="<i4") for seq in sequences])
        tokens = pb.TokenIds(ids=ids.tobytes(), lengths=[len(seq) for seq in sequences])
        request = pb.EmbedRequest(tokens=tokens, normalize=normalize, dimensions=dimensions)
        return decode(self.embed_request(request))

    def embed_request(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        return self._with_retries(lambda: self._stub.Embed(request, timeout=self._timeout))

    def info(self) -> pb.InfoResponse:
        return self._with_retries(lambda: self._stub.Info(pb.InfoRequest(), timeout=self._timeout))

    def _with_retries(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self._timeout
        budget = self.retry_budget
        for attempt in range(1, self._max_attempts + 1):
            try:
                answer = call()
            except grpc.RpcError as error:
                wait = self._retry_after(error, attempt)
                if wait is None:
                    raise
                budget.failed()
                last = attempt == self._max_attempts or time.monotonic() + wait > deadline
                if last or not budget.may_retry():
                    raise
                self.retries += 1
                self._sleep(wait)
            else:
                budget.answered()
                return answer
        raise AssertionError("unreachable")

    def _retry_after(self, error: grpc.RpcError, attempt: int) -> float | None:
        """Seconds to wait before retrying, or None when the error is final."""
        code = error.code() if isinstance(error, grpc.Call) else None
        if code not in RETRYABLE:
            return None
        jitter = random.uniform(0.8, 1.2)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(error, grpc.Call):
            for key, value in error.trailing_metadata() or ():
                if key == RETRY_PUSHBACK_KEY:
                    return int(value) / 1000 * jitter
        return self._backoff * 2 ** (attempt - 1) * jitter

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EmbedClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def decode(response: pb.EmbedResponse) -> np.ndarray:
    """The response's float32 little-endian buffer as a [count, dimensions] array."""
    return np.frombuffer(response.embeddings, dtype="<f4").reshape(response.count, response.dimensions)
