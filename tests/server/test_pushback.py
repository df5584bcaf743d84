"""The pushback enforced per connection: its windows with a fake clock, and the held calls' queue."""

from __future__ import annotations

import asyncio

import pytest

from kembed.frontend.pushback import ConnectionPushback, HeldCalls
from kembed.priority import Priority

INTERACTIVE, BATCH = Priority


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_refused_at_once_then_the_connection_waits_out_its_window() -> None:
    clock = FakeClock()
    pushback = ConnectionPushback(clock, refusals_at_once=3)
    assert not pushback.must_wait("a")
    for _ in range(3):  # a burst in flight before the client heard the first no
        assert not pushback.must_wait("a")
        pushback.refused("a", retry_after_ms=500)
    assert pushback.must_wait("a")  # the client called again before the pushback it was given
    assert not pushback.must_wait("b")  # other connections are not affected
    clock.now += 0.499
    assert pushback.must_wait("a")
    clock.now += 0.001
    assert not pushback.must_wait("a")  # the window has ended


def test_a_refusal_after_the_window_opens_a_new_one() -> None:
    clock = FakeClock()
    pushback = ConnectionPushback(clock, refusals_at_once=1)
    pushback.refused("a", retry_after_ms=100)
    clock.now += 0.2
    pushback.refused("a", retry_after_ms=1000)  # the old window had ended
    assert pushback.must_wait("a")
    clock.now += 0.9
    assert pushback.must_wait("a")


def test_windows_are_bounded_in_number() -> None:
    clock = FakeClock()
    pushback = ConnectionPushback(clock, refusals_at_once=1, max_windows=2)
    pushback.refused("a", 1000)
    pushback.refused("b", 1000)
    pushback.refused("c", 1000)  # no room, nothing ended: not enforced
    assert (len(pushback), pushback.must_wait("c")) == (2, False)
    clock.now += 2
    pushback.refused("c", 1000)  # the ended windows make room
    assert (len(pushback), pushback.must_wait("c")) == (1, True)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_held_calls_go_in_order_as_the_engine_has_room() -> None:
    pushback = ConnectionPushback(FakeClock(), refusals_at_once=1)
    pushback.refused("a", 60_000)
    room = {"tokens": 0}
    held = HeldCalls(pushback, lambda tokens, _: tokens <= room["tokens"], recheck_s=0)
    order: list[str] = []

    async def call(name: str, cost: int) -> None:
        await held.wait("a", cost, INTERACTIVE)
        room["tokens"] -= cost  # admitted: the engine's backlog grows by its cost
        order.append(name)

    calls = [asyncio.create_task(call(name, cost)) for name, cost in (("first", 64), ("second", 32), ("third", 32))]
    await settle()
    assert (order, len(held)) == ([], 3)  # no room: everyone waits, no CPU spent but a timer
    room["tokens"] = 96  # room for the first two together, not the third
    await settle()
    assert order == ["first", "second"]
    room["tokens"] += 32
    await settle()
    assert order == ["first", "second", "third"]
    await asyncio.gather(*calls)


async def test_a_held_call_goes_when_its_window_ends() -> None:
    clock = FakeClock()
    pushback = ConnectionPushback(clock, refusals_at_once=1)
    pushback.refused("a", 1000)
    pushback.refused("b", 5000)
    held = HeldCalls(pushback, lambda tokens, priority: False, recheck_s=0)
    a = asyncio.create_task(held.wait("a", 10, INTERACTIVE))
    b = asyncio.create_task(held.wait("b", 10, INTERACTIVE))
    await settle()
    clock.now += 1.0
    await settle()
    assert (a.done(), b.done()) == (True, False)  # a's window ended; the engine has no room
    held.release_all()  # draining
    await settle()
    assert b.done()
    await held.wait("b", 10, INTERACTIVE)  # once released, nothing waits any more


async def test_a_cancelled_held_call_leaves_the_queue() -> None:
    pushback = ConnectionPushback(FakeClock(), refusals_at_once=1)
    pushback.refused("a", 60_000)
    held = HeldCalls(pushback, lambda tokens, priority: False, recheck_s=0)
    waiting = asyncio.create_task(held.wait("a", 10, INTERACTIVE))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(held) == 0


async def test_an_interactive_call_the_engine_has_room_for_is_not_held_behind_batch_calls() -> None:
    pushback = ConnectionPushback(FakeClock(), refusals_at_once=1)
    pushback.refused("ingest", 60_000)
    pushback.refused("search", 60_000)
    held = HeldCalls(pushback, lambda tokens, priority: priority is INTERACTIVE, recheck_s=0)
    first = asyncio.create_task(held.wait("ingest", 10, BATCH))
    second = asyncio.create_task(held.wait("ingest", 10, BATCH))
    query = asyncio.create_task(held.wait("search", 10, INTERACTIVE))
    await settle()
    assert (first.done(), second.done(), query.done()) == (False, False, True)
    held.release_all()
    await asyncio.gather(first, second)


def test_a_window_is_per_connection_and_class() -> None:
    pushback = ConnectionPushback(FakeClock(), refusals_at_once=1)
    pushback.refused(("peer", BATCH), 1000)
    assert pushback.must_wait(("peer", BATCH)) and pushback.must_wait(("peer", 1))  # the proto's value
    assert not pushback.must_wait(("peer", INTERACTIVE))
