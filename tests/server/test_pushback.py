"""Refusals paced per client, with a fake clock: a burst answered at once however many, a client
refused faster than its rate answered at that rate, at most ``MAX_PACE_S`` late, each client alone;
paced answers bounded in number, and all answered at once by a drain."""

from __future__ import annotations

import asyncio

import pytest

from kembed.frontend.pushback import MAX_PACE_S, PACE_BYTES, PacedAnswers, RefusalPacer, refusal_weight, rest_client

RATE, BURST = 100.0, 50


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pacer(max_clients: int = 1024) -> tuple[FakeClock, RefusalPacer, list[None]]:
    clock, shared = FakeClock(), list[None]()
    return clock, RefusalPacer(RATE, BURST, clock, max_clients, on_shared=lambda: shared.append(None)), shared


def test_a_burst_is_answered_at_once_however_late_it_is_dispatched() -> None:
    clock, paced, _ = pacer()
    assert [paced.refused("a") for _ in range(BURST)] == [0.0] * BURST
    clock.now += 30.0  # a front end that gets to a burst late changes nothing
    assert [paced.refused("b") for _ in range(BURST)] == [0.0] * BURST


def test_past_its_burst_a_client_is_answered_at_its_rate() -> None:
    clock, paced, _ = pacer()
    for _ in range(BURST):
        paced.refused("a")
    assert [paced.refused("a") for _ in range(3)] == pytest.approx([1 / RATE, 2 / RATE, 3 / RATE])
    clock.now += 3 / RATE  # the debt is paid as time passes
    assert paced.refused("a") == pytest.approx(1 / RATE)


def test_a_refusal_weighs_its_bytes_and_large_bodies_are_paced_on_them() -> None:
    """Bodies of 925 KB refused at 79.5 a second were never paced (their count is under the rate):
    each weighs its bytes, so their client is paced on what reading them costs."""
    _, paced, _ = pacer()
    body = 8 * PACE_BYTES  # eight refusals a body
    assert refusal_weight(body) == 8.0 and refusal_weight(0) == refusal_weight(PACE_BYTES // 2) == 1.0
    assert [paced.refused("large", refusal_weight(body)) for _ in range(BURST // 8)] == [0.0] * (BURST // 8)
    assert paced.refused("large", refusal_weight(body)) == pytest.approx((8 - BURST % 8) / RATE)
    assert paced.refused("small") == 0.0  # its neighbour is not


def test_the_delay_is_bounded_however_fast_a_client_calls() -> None:
    _, paced, _ = pacer()
    delays = [paced.refused("a") for _ in range(BURST + 10 * int(RATE * MAX_PACE_S))]
    assert max(delays) == pytest.approx(MAX_PACE_S)
    assert delays[-1] == pytest.approx(MAX_PACE_S)


def test_one_client_paced_leaves_the_others_answered_at_once() -> None:
    _, paced, _ = pacer()
    for _ in range(BURST + 20):
        paced.refused("storm")
    assert paced.refused("storm") > 0
    assert paced.refused("neighbour") == 0.0


def test_a_client_that_waited_has_its_burst_again() -> None:
    clock, paced, _ = pacer()
    for _ in range(BURST + 20):
        paced.refused("a")
    clock.now += MAX_PACE_S + BURST / RATE
    assert [paced.refused("a") for _ in range(BURST)] == [0.0] * BURST


def test_past_the_table_clients_share_a_bucket_and_pacing_stays_on() -> None:
    clock, paced, shared = pacer(max_clients=4)
    for client in "abcd":
        paced.refused(client)
    assert len(paced) == 4 and not shared
    delays = [paced.refused(f"new-{i}") for i in range(BURST + 5)]  # each a client never seen: one bucket
    assert len(shared) == BURST + 5 and delays[-1] > 0
    clock.now += 2 * BURST / RATE  # the first four have refilled: forgotten, room for new clients
    assert paced.refused("e") == 0.0 and len(shared) == BURST + 5


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),  # one host is usually given a /64
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
        ("::ffff:10.1.2.3", "10.1.2.3"),  # an IPv4 client of a socket of both families
        ("", ""),
    ],
)
def test_a_rest_client_is_keyed_by_its_address(host: str, key: str) -> None:
    assert rest_client(host) == key


def test_a_client_is_in_debt_while_its_refusals_are_paced() -> None:
    clock, paced, _ = pacer()
    assert not paced.in_debt("a")  # never refused
    for _ in range(BURST):
        paced.refused("a")
    assert not paced.in_debt("a")  # its burst, answered at once
    paced.refused("a")
    assert paced.in_debt("a") and not paced.in_debt("b")
    clock.now += 2 / RATE  # its debt of one refusal paid
    assert not paced.in_debt("a")


async def test_paced_answers_are_bounded_in_number_and_past_the_bound_answered_at_once() -> None:
    """A front end holds at most ``limit`` paced answers: past that a refusal is answered at once,
    uncounted as paced; a drain answers every waiting one at once."""
    paced = list[None]()
    answers = PacedAnswers(RefusalPacer(1.0, 1, FakeClock()), limit=2, on_paced=lambda: paced.append(None))
    await answers.refused("storm")  # its burst: answered at once
    waiting = [asyncio.create_task(answers.refused("storm")) for _ in range(2)]
    await asyncio.sleep(0)
    assert answers.held == 2 and not any(task.done() for task in waiting)
    past_the_bound = asyncio.create_task(answers.refused("storm"))
    await asyncio.sleep(0)
    assert past_the_bound.done() and answers.held == 2 and len(paced) == 2
    answers.drain()
    await asyncio.gather(*waiting)
    assert answers.held == 0
    await answers.refused("storm")  # draining: none is paced
    assert len(paced) == 2
