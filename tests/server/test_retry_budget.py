"""The client's retry throttling, gRPC's ``retryThrottling``: failures spend tokens, answers earn a
tenth of one back, and retries stop below half."""

from __future__ import annotations

from kembed.client.embed_client import RetryBudget


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
