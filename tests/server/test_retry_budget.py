"""The client's retry throttling, gRPC's ``retryThrottling``: failures spend tokens, answers earn a
tenth of one back, and retries stop below half; and the policy around it (:class:`Retrying`)."""

from __future__ import annotations

import grpc

from kembed.client.errors import EmbedError, InvalidInput, Refused
from kembed.client.retries import Deadline, RetryBudget, Retrying


def test_retries_stop_once_failures_spend_half_the_tokens() -> None:
    budget = RetryBudget(max_tokens=10, token_ratio=0.1)
    allowed = []
    for _ in range(8):
        budget.failed()
        allowed.append(budget.may_retry())
    assert allowed == [True] * 4 + [False] * 4  # 9, 8, 7, 6 tokens left: above 5; then 5 and less


def test_answers_earn_retries_back_slowly() -> None:
    budget = RetryBudget(max_tokens=10, token_ratio=0.1)
    for _ in range(10):
        budget.failed()
    answers = 0
    while not budget.may_retry():
        budget.answered()
        answers += 1
    assert answers == 51  # from 0 tokens to above 5, a tenth a call


def test_tokens_stay_within_bounds() -> None:
    budget = RetryBudget(max_tokens=10, token_ratio=0.1)
    for _ in range(100):
        budget.answered()
    assert budget.tokens == 10
    for _ in range(100):
        budget.failed()
    assert budget.tokens == 0


def refused(pushback_ms: int) -> EmbedError:
    """The server's refusal as the client raises it, with its pushback."""
    return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded", pushback_ms / 1000)


def test_a_pushback_holds_every_request_of_the_client() -> None:
    retrying = Retrying(RetryBudget(), max_attempts=6, backoff_s=0.1)
    assert retrying.held_s() == 0
    wait = retrying.wait_s(refused(60_000), attempt=1, deadline=Deadline.after(600))
    assert wait is not None and 48 <= wait <= 72  # the pushback, with its jitter
    assert retrying.held_s() > 0  # the other requests wait for it too, not only the refused one
    assert retrying.retries == 1 and retrying.budget.tokens == 9


def test_unavailable_backs_off_alone_and_other_codes_are_final() -> None:
    retrying = Retrying(RetryBudget(), max_attempts=6, backoff_s=0.1)
    unavailable = EmbedError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    wait = retrying.wait_s(unavailable, attempt=3, deadline=Deadline.after(600))
    assert wait is not None and 0.32 <= wait <= 0.48  # 0.1 s doubled twice, with its jitter
    assert retrying.held_s() == 0
    assert retrying.wait_s(InvalidInput("texts[0]: bad"), attempt=1, deadline=Deadline.after(600)) is None


def test_a_pushback_past_the_deadline_is_not_waited_for() -> None:
    retrying = Retrying(RetryBudget(), max_attempts=6, backoff_s=0.1)
    assert retrying.wait_s(refused(60_000), attempt=1, deadline=Deadline.after(1)) is None
    assert retrying.retries == 0


def test_no_deadline_waits_out_any_pushback() -> None:
    retrying = Retrying(RetryBudget(), max_attempts=6, backoff_s=0.1)
    assert retrying.wait_s(refused(60_000), attempt=1, deadline=Deadline.after(None)) is not None
