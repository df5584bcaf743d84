"""The pushback enforced per client: its windows with a fake clock (a burst refused at once however
many, calls sent after a refusal held), and the held calls' queue."""

from __future__ import annotations

import asyncio

import pytest

from kembed.frontend.pushback import SAME_BURST_S, HeldCalls, PushbackWindows, rest_client
from kembed.priority import Priority

INTERACTIVE, BATCH = Priority
TIMEOUT = 30.0  # the client's deadline, from when it sends


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_refused_at_once_however_many_however_late_it_is_dispatched() -> None:
    """600 calls received within 80 ms (their deadlines say so), dispatched over half a second
    while the front end works through them: none was sent after its client could have heard the
    refusal of the call before it, so none waits."""
    clock = FakeClock()
    windows = PushbackWindows(clock)
    received = [100.0 + 0.08 * i / 600 for i in range(600)]
    held = 0
    for i, at in enumerate(received):
        clock.now = 100.005 + 0.0008 * i  # dispatched in turn, 0.8 ms each
        arrival, deadline = clock.now, at + TIMEOUT
        if windows.must_wait("conn", arrival, deadline):
            held += 1
        else:
            windows.refused("conn", 1000, arrival, deadline)
    assert held == 0


def test_a_client_that_calls_again_after_hearing_a_refusal_waits_out_its_window() -> None:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    windows.refused("conn", 500, arrival=100.0, deadline=100.0 + TIMEOUT)
    clock.now += 0.002  # heard it, called again at once: received after the refusal was sent
    assert windows.must_wait("conn", clock.now, clock.now + TIMEOUT)
    assert not windows.must_wait("other", clock.now, clock.now + TIMEOUT)  # other clients are not affected
    clock.now = 100.499
    assert windows.must_wait("conn", clock.now, clock.now + TIMEOUT)
    clock.now = 100.5
    assert not windows.must_wait("conn", clock.now, clock.now + TIMEOUT)  # the window has ended


def test_without_a_deadline_a_call_is_placed_by_its_dispatch() -> None:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    windows.refused("conn", 1000, arrival=100.0, deadline=None)
    clock.now += SAME_BURST_S / 2  # dispatched straight after the refusal: from the same burst
    assert not windows.must_wait("conn", clock.now, None)
    clock.now += SAME_BURST_S
    assert windows.must_wait("conn", clock.now, None)


def test_the_clients_timeout_is_learned_from_below_so_errors_refuse_at_once() -> None:
    """Receipt = deadline - the client's timeout, which the server does not know: the largest
    (deadline - dispatch) seen stands for it. A call with a longer timeout than any before looks
    received later (it may wait); with a shorter one, earlier (refused at once)."""
    clock = FakeClock()
    windows = PushbackWindows(clock)
    clock.now = 100.010
    windows.refused("conn", 1000, arrival=clock.now, deadline=100.0 + TIMEOUT)  # received 10 ms before
    clock.now = 100.020
    # Received at 100.015, after the refusal: from below, the timeout is 29.995 s (this call's own
    # deadline less its dispatch), which places it at its dispatch, later still.
    assert windows.must_wait("conn", clock.now, 100.015 + TIMEOUT)
    assert not windows.must_wait("conn", clock.now, 100.002 + TIMEOUT)  # received before the refusal
    assert not windows.must_wait("conn", clock.now, 100.015 + TIMEOUT / 2)  # a shorter timeout


def test_a_refusal_after_the_window_opens_a_new_one() -> None:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    windows.refused("a", 100, 100.0, None)
    clock.now += 0.2
    windows.refused("a", 1000, clock.now, None)  # the old window had ended
    clock.now += 0.5
    assert windows.must_wait("a", clock.now, None)


def test_past_the_table_clients_share_a_window_and_enforcement_stays_on() -> None:
    clock = FakeClock()
    shared = []
    windows = PushbackWindows(clock, max_windows=2, on_shared=lambda: shared.append(clock.now))
    windows.refused("a", 1000, clock.now, None)
    windows.refused("b", 1000, clock.now, None)
    windows.refused("c", 1000, clock.now, None)  # no room, nothing ended: the shared window
    assert len(shared) == 1 and len(windows) == 3
    clock.now += 0.01
    assert windows.must_wait("c", clock.now, None) and windows.must_wait("d", clock.now, None)  # shared
    assert windows.must_wait("a", clock.now, None)
    windows.refused("d", 1000, clock.now, None)  # on the shared window: counted
    assert len(shared) == 2
    clock.now += 2
    windows.refused("c", 1000, clock.now, None)  # the ended windows make room
    assert (len(windows), windows.must_wait("c", clock.now + 0.01, None)) == (1, True)
    assert not windows.must_wait("d", clock.now + 0.01, None)  # room again: clients without a window go free


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),  # one host is usually given a /64
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
        ("", ""),
    ],
)
def test_a_rest_client_is_keyed_by_its_address(host: str, key: str) -> None:
    assert rest_client(host) == key


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def held_windows(*clients: str, ms: int = 60_000) -> tuple[FakeClock, PushbackWindows]:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    for client in clients:
        windows.refused(client, ms, clock.now, None)
    return clock, windows


async def test_held_calls_go_in_order_as_the_engine_has_room() -> None:
    _, windows = held_windows("a")
    room = {"tokens": 0}
    held = HeldCalls(windows, lambda tokens, _: tokens <= room["tokens"], recheck_s=0)
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
    clock, windows = held_windows("a", ms=1000)
    windows.refused("b", 5000, clock.now, None)
    held = HeldCalls(windows, lambda tokens, priority: False, recheck_s=0)
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
    _, windows = held_windows("a")
    held = HeldCalls(windows, lambda tokens, priority: False, recheck_s=0)
    waiting = asyncio.create_task(held.wait("a", 10, INTERACTIVE))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert len(held) == 0


async def test_an_interactive_call_the_engine_has_room_for_is_not_held_behind_batch_calls() -> None:
    _, windows = held_windows("ingest", "search")
    held = HeldCalls(windows, lambda tokens, priority: priority is INTERACTIVE, recheck_s=0)
    first = asyncio.create_task(held.wait("ingest", 10, BATCH))
    second = asyncio.create_task(held.wait("ingest", 10, BATCH))
    query = asyncio.create_task(held.wait("search", 10, INTERACTIVE))
    await settle()
    assert (first.done(), second.done(), query.done()) == (False, False, True)
    held.release_all()
    await asyncio.gather(first, second)


def test_a_window_is_per_client_and_class() -> None:
    clock, windows = held_windows()
    windows.refused(("peer", BATCH), 1000, clock.now, None)
    clock.now += 0.01
    assert windows.must_wait(("peer", BATCH), clock.now, None) and windows.must_wait(("peer", 1), clock.now, None)
    assert not windows.must_wait(("peer", INTERACTIVE), clock.now, None)


def test_refusals_of_held_calls_do_not_carry_a_burst_on() -> None:
    """Calls released from a hold and refused again, one every half millisecond: each retry comes
    10 ms after its own refusal, within a moment of another's. The retries were sent after their
    clients heard a refusal: they wait, instead of passing for a burst that never ends."""
    clock = FakeClock()
    windows = PushbackWindows(clock)
    refusals = [clock.now + 0.0005 * i for i in range(40)]
    retries = sorted(at + 0.010 for at in refusals)
    events = sorted([(at, "refused") for at in refusals] + [(at, "retry") for at in retries])
    held = 0
    for at, kind in events:
        clock.now = at
        if kind == "refused":
            windows.refused("conn", 1000, at, None, held=True)
        elif windows.must_wait("conn", at, None):
            held += 1
        else:
            windows.refused("conn", 1000, at, None)
    assert held == len(retries)
