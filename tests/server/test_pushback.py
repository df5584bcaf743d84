"""The pushback enforced per client: its windows with a fake clock (a burst refused at once however
many, calls sent after a refusal held), and the held calls' queue."""

from __future__ import annotations

import asyncio

import pytest

from kembed.frontend.pushback import SAME_BURST_S, Arrival, HeldCalls, PushbackWindows, rest_client
from kembed.priority import Priority

INTERACTIVE, BATCH = Priority
TIMEOUT = 30.0  # the client's deadline, from when it sends


def call(client: object, dispatched: float, deadline: float | None = None, address: str = "10.0.0.1") -> Arrival:
    return Arrival(client, address, dispatched, deadline)


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
        if windows.must_wait(call("conn", arrival, deadline)):
            held += 1
        else:
            windows.refused(call("conn", arrival, deadline), 1000)
    assert held == 0


def test_a_client_that_calls_again_after_hearing_a_refusal_waits_out_its_window() -> None:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    windows.refused(call("conn", 100.0, 100.0 + TIMEOUT), 500)
    clock.now += 0.002  # heard it, called again at once: received after the refusal was sent
    assert windows.must_wait(call("conn", clock.now, clock.now + TIMEOUT))
    assert not windows.must_wait(call("other", clock.now, clock.now + TIMEOUT))  # other clients are not affected
    clock.now = 100.499
    assert windows.must_wait(call("conn", clock.now, clock.now + TIMEOUT))
    clock.now = 100.5
    assert not windows.must_wait(call("conn", clock.now, clock.now + TIMEOUT))  # the window has ended


def test_without_a_deadline_a_call_is_placed_by_its_dispatch() -> None:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    windows.refused(call("conn", 100.0, None), 1000)
    clock.now += SAME_BURST_S / 2  # dispatched straight after the refusal: from the same burst
    assert not windows.must_wait(call("conn", clock.now, None))
    clock.now += SAME_BURST_S
    assert windows.must_wait(call("conn", clock.now, None))


def test_the_timeout_is_learned_per_address_so_a_steady_backlog_is_seen() -> None:
    """Receipt = deadline - the client's timeout, which the server does not know: the largest
    (deadline - dispatch) of any call from the address stands for it. One call that found the
    front end idle makes it exact for every connection of that address; before any did, a steady
    backlog (every call dispatched 50 ms after it was received) would hide in it."""
    clock = FakeClock()
    windows = PushbackWindows(clock)
    assert not windows.must_wait(call("first", 100.0, 100.0 + TIMEOUT))  # dispatched as received: no window yet
    # Another connection of the address, in a backlogged front end: received at 100.000, 100.001, ...
    # each dispatched 50 ms later and refused 1 ms after that.
    held = 0
    for i in range(100):
        received = 100.0 + 0.001 * i
        clock.now = received + 0.050
        if windows.must_wait(call("second", clock.now, received + TIMEOUT)):
            held += 1
        else:
            clock.now += 0.001
            windows.refused(call("second", clock.now, received + TIMEOUT), 1000)
    assert held == 0
    # A call of the second connection received 20 ms after its latest refusal: it could have heard it.
    clock.now += 0.020
    assert windows.must_wait(call("second", clock.now, clock.now + TIMEOUT))
    # A client of the address with a shorter timeout looks received earlier: refused at once, not held.
    assert not windows.must_wait(call("second", clock.now, clock.now + TIMEOUT / 2))


def test_learned_timeouts_are_bounded_in_number() -> None:
    windows = PushbackWindows(FakeClock(), max_windows=2)
    for address in ("a", "b", "c"):
        windows.must_wait(call("x", 100.0, 130.0, address=address))
    assert list(windows._timeouts) == ["b", "c"]


def test_a_refusal_after_the_window_opens_a_new_one() -> None:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    windows.refused(call("a", 100.0, None), 100)
    clock.now += 0.2
    windows.refused(call("a", clock.now, None), 1000)  # the old window had ended
    clock.now += 0.5
    assert windows.must_wait(call("a", clock.now, None))


def test_past_the_table_clients_share_a_window_and_enforcement_stays_on() -> None:
    clock = FakeClock()
    shared = []
    windows = PushbackWindows(clock, max_windows=2, on_shared=lambda: shared.append(clock.now))
    windows.refused(call("a", clock.now, None), 1000)
    windows.refused(call("b", clock.now, None), 1000)
    windows.refused(call("c", clock.now, None), 1000)  # no room, nothing ended: the shared window
    assert len(shared) == 1 and len(windows) == 3
    clock.now += 0.01
    assert windows.must_wait(call("c", clock.now, None)) and windows.must_wait(call("d", clock.now, None))  # shared
    assert windows.must_wait(call("a", clock.now, None))
    windows.refused(call("d", clock.now, None), 1000)  # on the shared window: counted
    assert len(shared) == 2
    clock.now += 2
    windows.refused(call("c", clock.now, None), 1000)  # the ended windows make room
    assert (len(windows), windows.must_wait(call("c", clock.now + 0.01, None))) == (1, True)
    assert not windows.must_wait(call("d", clock.now + 0.01, None))  # room again: clients without a window go free


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


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def held_windows(*clients: str, ms: int = 60_000) -> tuple[FakeClock, PushbackWindows]:
    clock = FakeClock()
    windows = PushbackWindows(clock)
    for client in clients:
        windows.refused(call(client, clock.now, None), ms)
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
    windows.refused(call("b", clock.now, None), 5000)
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
    windows.refused(call(("peer", BATCH), clock.now, None), 1000)
    clock.now += 0.01
    assert windows.must_wait(call(("peer", BATCH), clock.now, None)) and windows.must_wait(
        call(("peer", 1), clock.now, None)
    )
    assert not windows.must_wait(call(("peer", INTERACTIVE), clock.now, None))


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
            windows.refused(call("conn", at, None), 1000, held=True)
        elif windows.must_wait(call("conn", at, None)):
            held += 1
        else:
            windows.refused(call("conn", at, None), 1000)
    assert held == len(retries)
