"""The library: texts in, a numpy array out, overload handled politely.

``embed`` takes any number of texts: it splits them into requests within the server's limits (read
once from ``Info``: texts per request, message size), sends them concurrently, at most ``in_flight``
at a time, in order, and joins the answers in order.

RESOURCE_EXHAUSTED is retried after the server's ``grpc-retry-pushback-ms`` (with jitter), and
UNAVAILABLE (warming up, draining, a replica going away) with exponential backoff, both bounded.
Retries are throttled as gRPC's ``retryThrottling`` does (:class:`RetryBudget`): while most calls
fail, a client stops retrying, so a fleet of clients sheds load before it reaches the server. The
requests of one client share its budget, and a pushback holds all of them, not only the refused one.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Generic, TypeVar, cast

import grpc
import numpy as np

from kembed.client.connection import MAX_MESSAGE_BYTES, Connection
from kembed.client.requests import Limits, Options, Part, Prompt, answered, located, plan
from kembed.contract import RETRY_ATTEMPT_KEY, RETRY_PUSHBACK_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

T = TypeVar("T")


def retry_marker(earlier: int) -> tuple[tuple[str, str], ...] | None:
    """The metadata that says an attempt is a retry, so the server does not count its work again as
    demand (kembed_demand_ratio)."""
    return ((RETRY_ATTEMPT_KEY, str(earlier)),) if earlier else None


ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
IN_FLIGHT = 4  # requests of one split list at once: enough to keep a server's batches full


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


class Retrying:
    """The retry policy both clients share: which failures are retried and after how long, within
    the attempts and the deadline, throttled by the :class:`RetryBudget`; a pushback holds every
    request of the client until it ends. Safe to share between threads."""

    def __init__(self, budget: RetryBudget, max_attempts: int, backoff_s: float, timeout_s: float) -> None:
        self.budget = budget
        self.retries = 0
        self._max_attempts = max_attempts
        self._backoff = backoff_s
        self._timeout = timeout_s
        self._held_until = 0.0  # monotonic: the latest pushback's end
        self._lock = threading.Lock()

    def deadline(self) -> float:
        return time.monotonic() + self._timeout

    def held_s(self) -> float:
        """How long an attempt must wait for a pushback the server gave (0: none)."""
        return max(0.0, self._held_until - time.monotonic())

    def answered(self) -> None:
        with self._lock:
            self.budget.answered()

    def wait_s(self, error: grpc.RpcError, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before retrying, or None when ``error`` is final (raise it)."""
        wait, pushback = self._retry_after(error, attempt)
        if wait is None:
            return None
        with self._lock:
            self.budget.failed()
            last = attempt == self._max_attempts or time.monotonic() + wait > deadline
            if last or not self.budget.may_retry():
                return None
            self.retries += 1
            if pushback:
                self._held_until = max(self._held_until, time.monotonic() + wait)
        return wait

    def _retry_after(self, error: grpc.RpcError, attempt: int) -> tuple[float | None, bool]:
        """(seconds to wait, or None when the error is final; whether the server said them)."""
        call = answered(error)
        if call is None or call.code() not in RETRYABLE:
            return None, False
        jitter = random.uniform(0.8, 1.2)
        if call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            trailers = cast(Iterable[tuple[str, str]], call.trailing_metadata() or ())
            pushback = dict(trailers).get(RETRY_PUSHBACK_KEY)
            if pushback is not None:
                return int(pushback) / 1000 * jitter, True
        return self._backoff * 2 ** (attempt - 1) * jitter, False


class ClientBase(Generic[ChannelT]):
    """What both clients hold: the connection and its channel, the retry policy and its budget,
    and the server's limits once read. ``EmbedClient("host:50051")``, or
    ``EmbedClient(Connection(...))``; the keyword arguments ``ca_file``, ``cert_file``, ``key_file``,
    ``round_robin`` and ``max_message_bytes`` build the :class:`Connection` for a target given as a
    string. ``timeout_s`` is each request's deadline, its retries included; ``in_flight`` how many
    requests of one split list go at once."""

    def __init__(
        self,
        target: str | Connection,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 6,
        backoff_s: float = 0.1,
        in_flight: int = IN_FLIGHT,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        round_robin: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        retry_budget: RetryBudget | None = None,
    ) -> None:
        if isinstance(target, str):
            target = Connection(target, ca_file, cert_file, key_file, max_message_bytes, round_robin)
        self.connection = target
        self._channel: ChannelT = self._open(target)
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self._timeout = timeout_s
        self._in_flight = in_flight
        self.retry_budget = retry_budget or RetryBudget()
        self._retrying = Retrying(self.retry_budget, max_attempts, backoff_s, timeout_s)
        self._limits: Limits | None = None  # the server's, read from Info at the first embed

    def _open(self, connection: Connection) -> ChannelT:
        raise NotImplementedError

    @property
    def retries(self) -> int:
        """How many attempts were retried, for callers that want to know."""
        return self._retrying.retries


class EmbedClient(ClientBase[grpc.Channel]):
    __doc__ = ClientBase.__doc__

    def _open(self, connection: Connection) -> grpc.Channel:
        return connection.channel()

    def embed(
        self,
        texts: Sequence[str],
        *,
        normalize: bool = True,
        dimensions: int = 0,
        truncate: bool = False,
        priority: str = "interactive",
        chunk: bool | None = None,
        prompt_name: str = "",
        prompt: str | None = None,
        input_type: str = "",
    ) -> np.ndarray:
        """Any number of texts, as requests within the server's limits; ``priority`` is
        ``"interactive"`` (a caller waits) or ``"batch"`` (an ingest, which queries go ahead of);
        ``chunk=True`` embeds a text longer than the model's limit as chunks (None: the server's default). At
        most one of ``prompt_name`` (one of the model's prompts), ``prompt`` (its text; ``""``: none)
        and ``input_type`` (query, passage or document); none: the model's default prompt."""
        options = Options(normalize, dimensions, truncate, priority, chunk, Prompt(prompt_name, prompt, input_type))
        parts = plan(texts, options, self.limits())
        if len(parts) == 1:
            return decode(self._embed_part(parts[0]))
        with ThreadPoolExecutor(min(self._in_flight, len(parts)), thread_name_prefix="kembed-embed") as pool:
            answers = pool.map(self._embed_part, parts)  # submitted in order, answered in order
            try:
                return np.concatenate([decode(answer) for answer in answers])
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the parts not started are not sent
                raise

    def embed_tokens(
        self, sequences: Sequence[Sequence[int]], *, normalize: bool = True, dimensions: int = 0
    ) -> np.ndarray:
        """Pre-tokenized input (ids including the model's special tokens), as one request."""
        return decode(self.embed_request(tokens_request(sequences, normalize, dimensions)))

    def embed_request(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        return self._with_retries(
            lambda earlier: self._stub.Embed(request, timeout=self._timeout, metadata=retry_marker(earlier))
        )

    def info(self) -> pb.InfoResponse:
        return self._with_retries(lambda _: self._stub.Info(pb.InfoRequest(), timeout=self._timeout))

    def limits(self) -> Limits:
        """What one request may carry: the server's limits, read once."""
        if self._limits is None:
            self._limits = Limits.of(self.connection, self.info())
        return self._limits

    def _embed_part(self, part: Part) -> pb.EmbedResponse:
        try:
            return self.embed_request(part.request)
        except grpc.RpcError as error:
            raise located(error, part) from None

    def _with_retries(self, call: Callable[[int], T]) -> T:
        retrying = self._retrying
        deadline = retrying.deadline()
        attempt = 0
        while True:
            attempt += 1
            if held := retrying.held_s():  # another request's pushback holds this one too
                time.sleep(held)
            try:
                answer = call(attempt - 1)  # the earlier attempts: a retry says so (retry_marker)
            except grpc.RpcError as error:
                wait = retrying.wait_s(error, attempt, deadline)
                if wait is None:
                    raise
                time.sleep(wait)
            else:
                retrying.answered()
                return answer

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EmbedClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def tokens_request(sequences: Sequence[Sequence[int]], normalize: bool, dimensions: int) -> pb.EmbedRequest:
    ids = np.concatenate([np.asarray(seq, dtype="<i4") for seq in sequences])
    tokens = pb.TokenIds(ids=ids.tobytes(), lengths=[len(seq) for seq in sequences])
    return pb.EmbedRequest(tokens=tokens, normalize=normalize, dimensions=dimensions)


def decode(response: pb.EmbedResponse) -> np.ndarray:
    """The response's float32 little-endian buffer as a [count, dimensions] array."""
    return np.frombuffer(response.embeddings, dtype="<f4").reshape(response.count, response.dimensions)
