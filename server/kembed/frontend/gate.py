"""Whether a front end takes calls (:class:`Gate`), and the refusals of a call it does not take: one
while the engine warms up, one while the pod drains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kembed.domain.errors import EmbedError, Failure

DRAINING_PUSHBACK_MS = 100  # a draining pod's refusal: come back at once, on a new connection


def warming_up() -> EmbedError:
    return EmbedError(Failure.UNAVAILABLE, "server is warming up: retry shortly")


def draining() -> EmbedError:
    """With a pushback, so a client's retry policy (gRPC's, the openai SDK's) sends the call again on
    another replica: the Service has taken this pod out of its endpoints before its SIGTERM."""
    return EmbedError(Failure.UNAVAILABLE, "server is draining: retry on another replica", DRAINING_PUSHBACK_MS)


class Gate:
    """Whether requests are still taken, and how many are in progress, so a drain knows when
    everything accepted has been answered. Closed when this front end drains, or as soon as the
    supervisor marks the whole pod draining (a front end may see its SIGTERM a moment later)."""

    def __init__(self, pod_draining: Callable[[], bool]) -> None:
        self._pod_draining = pod_draining
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.check_open()
        self.hold()

    def check_open(self) -> None:
        if self.draining or self._pod_draining():
            raise draining()

    def hold(self) -> None:
        """Count work in progress whether or not the gate is open: a computed answer still to write."""
        self.active += 1
        self._idle.clear()

    def leave(self, count: int = 1) -> None:
        self.active -= count
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.active:  # again: a stream may hold an answer before this waiter runs
            await self._idle.wait()
