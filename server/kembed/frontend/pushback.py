"""The pushback, enforced per client: a client that ignores it waits anyway, at no CPU cost.

A refused call tells its client when to come back (``grpc-retry-pushback-ms``, ``Retry-After``). A
client that calls again sooner costs a refusal each time, and a few such clients, retrying as fast
as they are told no, spend the cores the engine computes with on saying no
(``docs/decisions/cheap-refusals.md``). So a client's first refusal opens a window as long as its
pushback, and within it the client's calls are of two kinds:

- **Sent before it could have heard a refusal**: a burst, however many calls, refused at once. What
  the server can observe is when a call was *received* and when each refusal was *sent* (gRPC python
  shows neither stream ids nor pings). A call received before its client's latest refusal was sent
  (within ``SAME_BURST_S``) was sent before its client could have heard that refusal: the client
  pipelined it, as a burst does. The receipt time is not when the call reaches the service (a
  front end works through a burst of 600 calls for half a second): gRPC stamps a call's deadline
  when its headers arrive, so for a call with a deadline, receipt = deadline - the client's timeout.
  The timeout is learned per client address, from every call, as the largest (deadline - dispatch)
  seen: a bound from below, tight once one call found the front end idle, and the largest of the
  timeouts of the address's clients, so that an error places a call earlier (refused at once),
  not later (held). A call without a deadline is placed by its dispatch.
- **Sent after**: held (:class:`HeldCalls`, first come first served) until the engine has room for
  it or the window ends, whichever is first, and then handled as if it had just arrived. Held, it
  costs a timer's share of CPU; the engine gets it as soon as it can take it, so a storm of such
  calls keeps the engine busy instead of starving it.

A client is whatever key the edge gives (:class:`Arrival`): on gRPC the connection (a channel), on
REST the client's address (:func:`rest_client`), so opening a new connection per call does not
evade it. Behind a
proxy every client shares the proxy's address and so its windows: a refusal to one of them holds
the others' calls too, until the engine has room for them (none of them is refused for it). A
window also belongs to a priority class: the pushback a batch call was told is no reason to hold an
interactive call of the same client, which the engine has room for sooner.

Windows are bounded in number (``MAX_WINDOWS``); past that, clients without a window of their own
share one (``kembed_pushback_shared_total`` counts the refusals that open or extend it): enforcement
coarsens, it never turns off. Learned timeouts are bounded likewise (the oldest address is
forgotten).

:class:`PushbackWindows` is pure (the clock is injected); :class:`HeldCalls` is the small asyncio
shell around it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from kembed.priority import Priority

# A call received up to this long after its client's latest refusal was sent is counted as sent
# before the client heard it: gRPC stamps deadlines to the millisecond, and no client hears a
# refusal and sends again within a millisecond but over loopback.
SAME_BURST_S = 0.001
# Windows kept at most: about 200 bytes each.
MAX_WINDOWS = 4096
# While calls are held, how often to look for room in the engine: the engine's backlog is a drain
# budget of work (seconds), so this only adds a little latency to calls that ignored their pushback.
RECHECK_S = 0.02
SHARED = object()  # the key of the window clients share once there is no room for one of their own


class Arrival(NamedTuple):
    """A call, as the pushback sees it."""

    client: Hashable  # whose window: a connection (gRPC) or an address (REST), and a class
    address: str  # where the client's timeout is learned
    dispatched: float  # when it reached the service (monotonic seconds)
    deadline: float | None  # the client's own deadline, if it set one


@dataclass
class _Window:
    ends: float  # monotonic seconds
    answered: float  # when the client's latest refusal was sent


class PushbackWindows:
    """Each client's pushback window: until when, and whether a call comes from a burst or after."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_windows: int = MAX_WINDOWS,
        on_shared: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        self._max_windows = max_windows
        self._on_shared = on_shared  # a refusal went to the shared window
        self._windows: dict[Hashable, _Window] = {}
        self._sweep_at = -math.inf  # no window ends before this: a sweep would find nothing
        self._timeouts: dict[str, float] = {}  # per address, from below: the largest (deadline - dispatch)

    def must_wait(self, arrival: Arrival) -> bool:
        """Whether the call must wait: its client's window is open and the call was received after
        the client's latest refusal was sent."""
        received = self._received(arrival)
        window = self._find(arrival.client)
        if window is None or window.ends <= self._clock():
            return False
        return received > window.answered + SAME_BURST_S

    def is_open(self, client: Hashable) -> bool:
        """Whether the client's window is still open."""
        window = self._find(client)
        return window is not None and window.ends > self._clock()

    def refused(self, arrival: Arrival, retry_after_ms: int, held: bool = False) -> None:
        """A call was refused with this pushback, now. A call that had been held was sent after its
        client heard a refusal: its own refusal does not carry a burst on (else the retries of many
        calls released together would be refused at once, each within a moment of another's
        refusal, and never held again)."""
        now = self._clock()
        window = self._find(arrival.client)
        if window is not None and window.ends > now:
            if not held:
                window.answered = now
            if window is self._windows.get(SHARED):
                self._on_shared()
            return
        self._windows[self._room_for(arrival.client, now)] = _Window(now + retry_after_ms / 1000, now)

    def __len__(self) -> int:
        return len(self._windows)

    def _find(self, client: Hashable) -> _Window | None:
        """The client's own window, or the shared one while the table is full."""
        window = self._windows.get(client)
        if window is None and len(self._windows) >= self._max_windows:
            window = self._windows.get(SHARED)
        return window

    def _received(self, arrival: Arrival) -> float:
        """When the call was received, as near as the server can tell; every call with a deadline
        teaches its address's timeout."""
        if arrival.deadline is None:
            return arrival.dispatched
        timeouts, address = self._timeouts, arrival.address
        timeout = max(timeouts.get(address, -math.inf), arrival.deadline - arrival.dispatched)
        if address not in timeouts and len(timeouts) >= self._max_windows:
            del timeouts[next(iter(timeouts))]  # the address learned longest ago
        timeouts[address] = timeout
        return arrival.deadline - timeout

    def _room_for(self, client: Hashable, now: float) -> Hashable:
        """The key a new window goes under: the client's own, or the shared one when the table is full."""
        if client in self._windows or len(self._windows) < self._max_windows:
            return client
        if now >= self._sweep_at:
            ended = [key for key, window in self._windows.items() if window.ends <= now]
            for key in ended:
                del self._windows[key]
            self._sweep_at = min((window.ends for window in self._windows.values()), default=now)
            if len(self._windows) < self._max_windows:
                return client
        self._windows.pop(SHARED, None)  # an ended shared window: a new one replaces it
        self._on_shared()
        return SHARED


def rest_client(host: str) -> str:
    """A REST client's key: its address, an IPv6 one by its /64 (what one host is usually given), an
    IPv4 one on a socket of both families (``::ffff:10.0.0.7``) as itself."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


@dataclass(eq=False)
class _Held:
    client: Hashable
    least_cost: int  # padded tokens, a lower bound: what room in the engine it needs at least
    priority: Priority
    released: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queued: bool = True


class HeldCalls:
    """Calls that came too soon after their client's refusal, first come first served within their
    class (an interactive call the engine has room for is not held behind a batch call)."""

    def __init__(
        self,
        windows: PushbackWindows,
        has_room: Callable[[int, Priority], bool],
        recheck_s: float = RECHECK_S,
    ) -> None:
        self._windows = windows
        self._has_room = has_room  # whether the engine could take this many more padded tokens of a class
        self._recheck_s = recheck_s
        self._queue: deque[_Held] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._released_all = False

    def __len__(self) -> int:
        return len(self._queue)

    async def wait(self, client: Hashable, least_cost: int, priority: Priority) -> None:
        """Wait until the engine has room for ``least_cost`` more padded tokens of the class (in
        turn), or the client's window ends, or everything is released."""
        if self._released_all:
            return
        held = _Held(client, least_cost, priority)
        self._queue.append(held)
        self._schedule()
        try:
            await held.released
        finally:
            if held.queued:  # cancelled (deadline, client gone) while held
                self._queue.remove(held)

    def release_all(self) -> None:
        """Let every held call go on, and hold none from now on (the front end is draining)."""
        self._released_all = True
        while self._queue:
            self._release(self._queue.popleft())

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._recheck_s, self._recheck)

    def _recheck(self) -> None:
        """Release the calls whose window ended, then, in order within each class, as many as the
        engine has room for."""
        self._timer = None
        waiting = deque[_Held]()
        taken = 0
        blocked: set[Priority] = set()  # a class's first call without room holds the rest of it
        for held in self._queue:
            if not self._windows.is_open(held.client):
                self._release(held)
            elif held.priority not in blocked and self._has_room(taken + held.least_cost, held.priority):
                taken += held.least_cost
                self._release(held)
            else:
                blocked.add(held.priority)
                waiting.append(held)
        self._queue = waiting
        if self._queue:
            self._schedule()

    @staticmethod
    def _release(held: _Held) -> None:
        held.queued = False
        if not held.released.done():
            held.released.set_result(None)
