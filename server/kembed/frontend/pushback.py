"""The pushback, enforced per connection: a client that ignores it waits anyway, at no CPU cost.

A refused call tells its client when to come back (``grpc-retry-pushback-ms``). A client that calls
again sooner costs a refusal each time, and a few such clients, retrying as fast as they are told
no, spend the cores the engine computes with on saying no (``docs/decisions/cheap-refusals.md``). So the first refusal
on a connection opens a window as long as its pushback. Within the window the connection may be
refused ``refusals_at_once`` times at once: a burst of calls that were in flight before its client
could hear the first no. A call arriving after that, before the window ends, comes from a client
that did not wait: it is held (:class:`HeldCalls`, first come first served) until the engine has
room for it or the window ends, whichever is first, and is then handled as if it had just arrived.
Held, it costs a timer's share of CPU; the engine gets it as soon as it can take it, so a storm of
such calls keeps the engine busy instead of starving it.

A window belongs to a connection and a priority class: the pushback a batch call was told is no
reason to hold an interactive call on the same connection, which the engine has room for sooner.

:class:`ConnectionPushback` is pure (the clock is injected); :class:`HeldCalls` is the small
asyncio shell around it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from kembed.priority import Priority

# A burst on one connection refused at once: more calls than HTTP/2 peers usually let one
# connection carry at a time (100 streams is the common default).
REFUSALS_AT_ONCE = 128
# Open windows kept at most, before the ended ones are dropped (bounds memory under many clients).
MAX_WINDOWS = 4096
# While calls are held, how often to look for room in the engine: the engine's backlog is a drain
# budget of work (seconds), so this only adds a little latency to calls that ignored their pushback.
RECHECK_S = 0.02


@dataclass
class _Window:
    ends: float  # monotonic seconds
    refusals_left: int


class ConnectionPushback:
    """Each connection's pushback window: how many refusals it may still get at once, and until when.
    A connection is whatever key the caller gives (the front end's: the peer and the priority class)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        refusals_at_once: int = REFUSALS_AT_ONCE,
        max_windows: int = MAX_WINDOWS,
    ) -> None:
        self._clock = clock
        self._refusals_at_once = refusals_at_once
        self._max_windows = max_windows
        self._windows: dict[Hashable, _Window] = {}

    def must_wait(self, connection: Hashable) -> bool:
        """Whether a call arriving now on ``connection`` comes too soon: its window is open and
        has no refusals at once left."""
        window = self._windows.get(connection)
        return window is not None and window.refusals_left <= 0 and window.ends > self._clock()

    def refused(self, connection: Hashable, retry_after_ms: int) -> None:
        """A call on ``connection`` was refused with this pushback."""
        now = self._clock()
        window = self._windows.get(connection)
        if window is not None and window.ends > now:
            window.refusals_left -= 1
            return
        if len(self._windows) >= self._max_windows:
            self._drop_ended(now)
            if len(self._windows) >= self._max_windows:
                return  # as many clients in their windows as memory allows: this one goes unenforced
        self._windows[connection] = _Window(now + retry_after_ms / 1000, self._refusals_at_once - 1)

    def __len__(self) -> int:
        return len(self._windows)

    def _drop_ended(self, now: float) -> None:
        for connection in [c for c, window in self._windows.items() if window.ends <= now]:
            del self._windows[connection]


@dataclass(eq=False)
class _Held:
    connection: Hashable
    least_cost: int  # padded tokens, a lower bound: what room in the engine it needs at least
    priority: Priority
    released: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queued: bool = True


class HeldCalls:
    """Calls that came too soon after their connection's refusal, first come first served within
    their class (an interactive call the engine has room for is not held behind a batch call)."""

    def __init__(
        self,
        pushback: ConnectionPushback,
        has_room: Callable[[int, Priority], bool],
        recheck_s: float = RECHECK_S,
    ) -> None:
        self._pushback = pushback
        self._has_room = has_room  # whether the engine could take this many more padded tokens of a class
        self._recheck_s = recheck_s
        self._queue: deque[_Held] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._released_all = False

    def __len__(self) -> int:
        return len(self._queue)

    async def wait(self, connection: Hashable, least_cost: int, priority: Priority) -> None:
        """Wait until the engine has room for ``least_cost`` more padded tokens of the class (in
        turn), or the connection's window ends, or everything is released."""
        if self._released_all:
            return
        held = _Held(connection, least_cost, priority)
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
            if not self._pushback.must_wait(held.connection):
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
