"""When a failed attempt is tried again: gRPC's retry throttling (:class:`RetryBudget`), the
pushback or the backoff (:class:`Retrying`), all within one deadline for the whole call (:class:`Deadline`).

RESOURCE_EXHAUSTED is retried after the server's ``grpc-retry-pushback-ms`` (with jitter), and
UNAVAILABLE (warming up, draining, a replica going away) with exponential backoff, both bounded by
the attempts, the deadline and the budget. A pushback holds every request of the client, not only
the refused one. A refusal of one of the client's own parts while others are in flight is not a
retry at all: its window was too wide (:mod:`.aio`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import grpc

from kembed.client.errors import EmbedError

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
# An attempt's own deadline when the call has none: long enough for any admitted request.
ATTEMPT_TIMEOUT_S = 300.0


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


@dataclass(frozen=True)
class Deadline:
    """One call's end (``timeout_s`` after it started; none: ``math.inf``), its retries and waits included."""

    at: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(math.inf if seconds is None else time.monotonic() + seconds)

    def left(self) -> float:
        return self.at - time.monotonic()

    def attempt_s(self) -> float:
        """An attempt's timeout: what is left of the call."""
        return min(self.left(), ATTEMPT_TIMEOUT_S)


class Retrying:
    """The retry policy of a client's calls: which failures are retried and after how long, within
    the attempts and the deadline, throttled by the :class:`RetryBudget`; a pushback holds every
    request of the client until it ends. Used from the client's one event loop."""

    def __init__(self, budget: RetryBudget, max_attempts: int, backoff_s: float) -> None:
        self.budget = budget
        self.retries = 0
        self._max_attempts = max_attempts
        self._backoff = backoff_s
        self._held_until = 0.0  # monotonic: the latest pushback's end

    def held_s(self) -> float:
        """How long an attempt must wait for a pushback the server gave (0: none)."""
        return max(0.0, self._held_until - time.monotonic())

    def answered(self) -> None:
        self.budget.answered()

    def hold(self, seconds: float) -> None:
        """Hold every attempt of the client for a pushback that is not a retry (its own window's)."""
        self._held_until = max(self._held_until, time.monotonic() + seconds)

    def wait_s(self, error: EmbedError, attempt: int, deadline: Deadline) -> float | None:
        """Seconds to wait before retrying, or None when ``error`` is final (raise it): not
        retryable, the last attempt, a wait past the deadline, or the budget spent."""
        if error.code() not in RETRYABLE:
            return None
        jitter = random.uniform(0.8, 1.2)
        pushback = error.retry_after_s if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED else None
        wait = (pushback if pushback is not None else self._backoff * 2 ** (attempt - 1)) * jitter
        self.budget.failed()
        if attempt >= self._max_attempts or wait > deadline.left() or not self.budget.may_retry():
            return None
        self.retries += 1
        if pushback is not None:
            self.hold(wait)
        return wait
