"""The client's share of the server's admission budget (kembed.client.window.Budget): a text's cost
from its characters at the tokens per character the answers showed, padded to the server's buckets;
requests cut to a quarter of the budget and kept out within half of it; the budget read again while
requests go. Pure but for the re-read, which a fake stub answers. What it is for, a lone client that
the server never refuses, is tested against a real server in test_lone_client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from kembed.client import window
from kembed.client.corpus.stream import MIN_STREAM_S, stream_seconds
from kembed.client.window import BUDGET_SHARE, PART_SHARE, Budget
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

BUCKETS = [16, 32, 64, 128, 256]


class Stub:
    """Answers Info with the budget it is told."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.calls = 0

    async def Info(self, request: pb.InfoRequest, **call: Any) -> pb.InfoResponse:  # the stub's, with its timeout
        self.calls += 1
        return pb.InfoResponse(admission_budget_tokens=self.tokens)


def budget(tokens: int = 4096, stub: Stub | None = None, clock: Callable[[], float] = time.monotonic) -> Budget:
    info = pb.InfoResponse(admission_budget_tokens=tokens, buckets=BUCKETS, max_input_tokens=256)
    return Budget(info, cast(pb_grpc.EmbedderStub, stub or Stub(tokens)), clock)


def learned(tokens_per_char: float, tokens: int = 4096) -> Budget:
    """A budget that an answer of 100 characters and ``100 * tokens_per_char`` tokens has taught."""
    b = budget(tokens)
    b.answered(["x" * 100], [round(100 * tokens_per_char)])
    return b


def test_a_texts_cost_is_its_estimated_tokens_padded_to_its_bucket():
    b = learned(0.25)
    # 40 characters are 10 tokens (bucket 16), 200 are 50 (64), 2,000 are 500: cut to the model's 256.
    assert b.costs(["a" * 40, "b" * 200, "c" * 2000, ""]).tolist() == [16, 64, 256, 0]
    assert b.cost(["a" * 40, "b" * 200]) == 80


def test_chunked_a_long_text_costs_its_chunks():
    b = learned(0.25)
    # 500 tokens are two chunks of 250 (bucket 256 each); a short text is one chunk, itself.
    assert b.costs(["c" * 2000, "a" * 40], chunked=True).tolist() == [512, 16]


def test_a_request_carries_a_quarter_of_the_budget_once_answers_have_shown_the_tokens():
    b = learned(0.25, tokens=4096)
    texts = ["a" * 40] * 1000  # 16 padded tokens each
    part = 4096 * BUDGET_SHARE * PART_SHARE
    assert b.fitting(texts) == int(part // 16) == 64
    assert b.fitting(["c" * 2000] * 10) == 4  # 256 each
    assert b.fitting(["c" * 100_000]) == 1  # one over the part still goes, alone
    assert budget().fitting(texts) == 1000  # nothing learned yet: not cut by the budget


def test_requests_out_stay_within_half_the_budget_and_one_goes_alone():
    b = learned(0.25, tokens=4096)
    assert b.admits(4000)  # nothing out: it goes alone, whatever it costs
    b.sent(1024)
    assert b.admits(1024) and not b.admits(1025)  # 2,048 is half
    b.sent(1024)
    b.settled(1024)
    assert b.out == 1024 and b.admits(1024)
    unlearned = budget()
    unlearned.sent(16)
    assert not unlearned.admits(16)  # before any answer, one request at a time


def test_a_server_that_states_no_budget_is_not_held_to_one():
    b = budget(tokens=0)
    b.sent(10**6)
    assert b.admits(10**6) and b.fitting(["a"] * 5000) == 5000


def test_the_tokens_per_character_follow_the_recent_answers():
    b = learned(0.25)
    for _ in range(40):  # longer words now: a token per two characters
        b.answered(["y" * 100], [50])
    assert b.costs(["a" * 60]).tolist() == [32]  # 30 tokens, not 15


def test_the_budget_is_read_again_every_refresh_while_requests_go():
    now = [100.0]

    async def run() -> tuple[int, int]:
        stub = Stub(4096)
        b = budget(4096, stub, lambda: now[0])
        b.read_if_due()  # just read: not due
        stub.tokens = 1000
        now[0] += window.REFRESH_S
        b.read_if_due()
        b.read_if_due()  # one reading at a time
        await asyncio.sleep(0)
        return stub.calls, b.tokens

    assert asyncio.run(run()) == (1, 1000)


def test_a_stream_lives_half_the_grace_the_server_gives_calls_past_their_connections_age():
    assert stream_seconds(pb.InfoResponse(max_connection_age_grace_ms=25_000)) == 12.5
    assert stream_seconds(pb.InfoResponse(max_connection_age_grace_ms=100)) == MIN_STREAM_S
    assert stream_seconds(pb.InfoResponse()) is None  # a server that does not say: streams are not rotated


def test_costs_are_vectorised_over_many_texts():
    b = learned(0.3)
    costs = b.costs(["word " * n for n in range(1, 2001)])
    assert costs.shape == (2000,) and np.all(np.isin(costs, BUCKETS))
