"""What a front end's gRPC calls hold while it handles them: a slot each (:class:`CallSlots`, taken
back from a call that sends nothing while others wait), and, for an EmbedStream, a window of
requests and answers (:class:`StreamWindow`) past which it stops reading its client.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kembed.domain.errors import EmbedError, Failure
from kembed.frontend.budget import RETRY_AFTER_MS

# What one EmbedStream may hold, from reading a request until its answer is written: requests, and
# bytes (the requests' and their answers'), at most one of the largest messages. Past either, the
# stream stops reading.
MAX_STREAM_REQUESTS = 256


class StreamWindow:
    """What one EmbedStream holds, from reading a request until its answer is written: at most
    ``requests`` requests and ``nbytes`` bytes of requests and answers (a larger request goes
    alone). A client that stops reading fills it, and the stream stops reading its requests, so
    gRPC's flow control stops the client."""

    def __init__(self, nbytes: int, requests: int = MAX_STREAM_REQUESTS) -> None:
        self._max_bytes = nbytes
        self._max_requests = requests
        self._requests = 0
        self._bytes = 0
        self._room = asyncio.Event()

    async def take(self, nbytes: int) -> None:
        """Wait for room for a request of ``nbytes``, and hold it."""
        while self._requests and (self._requests >= self._max_requests or self._bytes + nbytes > self._max_bytes):
            self._room.clear()
            await self._room.wait()
        self._requests += 1
        self._bytes += nbytes

    def give_back(self, nbytes: int) -> None:
        """A request's answer was written: it, and the request, held ``nbytes``."""
        self._requests -= 1
        self._bytes -= nbytes
        self._room.set()

    def empty(self) -> bool:
        return not self._requests


@dataclass(eq=False, slots=True)
class Slot:
    """One call's slot. ``task`` is cancelled if the slot is taken back while its call waits for a
    message (``evicted``)."""

    connection: str
    task: asyncio.Task[object] | None
    evicted: bool = False


class CallSlots:
    """The Embed calls (unary or stream) a front end handles at once, from before a request is read
    until it is answered, or refused and its answer paced; single-threaded (the event loop's).

    A call holds its slot before its message is read (gRPC holds the message as it arrives), so a
    client could hold every slot by sending a call's head and never its message. A slot is held
    unconditionally only once a message has arrived: while every slot is taken, a new call takes
    the slot of the call that has waited longest for its message on the connection with the most
    such calls, if that connection has more of them than the new call's own. That call is refused
    (RESOURCE_EXHAUSTED, with a pushback). A stream waits for a message whenever none of its
    requests is in flight. A connection's own calls never take each other's slots: a burst still
    hears "busy" past the slots, as before."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.taken = 0
        # Per connection, the slots whose calls wait for a message, oldest first; a connection is
        # here only while it has one, in the order it came to have one.
        self._waiting: dict[str, dict[Slot, None]] = {}

    def take(self, connection: str, task: asyncio.Task[object] | None) -> Slot | None:
        """Hold a slot for a call of ``connection`` that waits for its message in ``task``, if one
        is free or can be taken back from a call that has sent nothing."""
        if self.taken >= self.most and not self._take_back(connection):
            return None
        self.taken += 1
        slot = Slot(connection, task)
        self.wait(slot)
        return slot

    def wait(self, slot: Slot, task: asyncio.Task[object] | None = None) -> None:
        """The slot's call waits for a message (in ``task``, if it is another than before)."""
        if task is not None:
            slot.task = task
        self._waiting.setdefault(slot.connection, {})[slot] = None

    def read(self, slot: Slot) -> None:
        """A message of the slot's call arrived: its slot is held until it is answered."""
        waiting = self._waiting.get(slot.connection)
        if waiting is not None and waiting.pop(slot, False) is None and not waiting:
            del self._waiting[slot.connection]

    def give_back(self, slot: Slot) -> None:
        if not slot.evicted:  # an evicted slot was given back when it was taken back
            self.read(slot)
            self.taken -= 1

    def _take_back(self, connection: str) -> bool:
        """Free the slot of the call that has waited longest for its message on the connection
        with the most such calls, if it has more than ``connection``; whether one was freed."""
        waiting = self._waiting
        if not waiting:
            return False
        holder = max(waiting, key=lambda key: len(waiting[key]))  # ties: the one waiting longest
        if len(waiting[holder]) <= len(waiting.get(connection, ())):
            return False
        slot = next(iter(waiting[holder]))
        self.give_back(slot)
        slot.evicted = True
        if slot.task is not None:
            slot.task.cancel()
        return True

    def busy(self) -> EmbedError:
        return EmbedError(
            Failure.REJECTED, f"this server handles {self.most} calls at once: retry shortly", RETRY_AFTER_MS
        )

    def taken_back(self) -> EmbedError:
        return EmbedError(
            Failure.REJECTED,
            "no message arrived while calls on other connections waited for a slot: send it with the call",
            RETRY_AFTER_MS,
        )
