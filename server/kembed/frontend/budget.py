"""A front end's memory budget: the bytes its calls hold, weighed, against a bound derived from the
pod's memory, so that no client can make a front end grow past it.

Each part of a call's path weighs what it holds, from when it starts holding it until it lets go:
the REST edge a body being read (chunk by chunk as it arrives: a head holds nothing, and a client's
bodies being read at most ``1 / BODY_SHARE`` of the budget) and an answer until it is written; the
gRPC edge a request message and its answer, and a stream the requests it reads ahead; the service
a call from its arrival until it is answered (screened, tokenized, queued, computed). What does not
fit is refused at once: RESOURCE_EXHAUSTED or 429, with a pushback.

The budget (``docs/operations.md``, "Memory"): a quarter of the pod's memory, shared by its front
ends. gRPC reads a whole message before any handler sees it, so what it may hold unweighed
(``max_concurrent_rpcs`` messages of ``max_message_bytes``) is kept within one budget more: see
:func:`grpc_calls`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from kembed.domain.errors import EmbedError, Failure

SHARE = 4  # the front ends' calls may hold a quarter of the pod's memory; the rest is the engine's and Python's
MIN_BUDGET_MESSAGES = 8  # a budget holds at least this many of the largest requests, whatever the pod's size
MESSAGE_COPIES = 3  # a gRPC message as it is read: gRPC's buffer, Python's bytes, the parsed message
BODY_WEIGHT = 2  # a REST body as it is read: its bytes in flight, and what they are parsed into
BODY_SHARE = 4  # a REST client's bodies being read hold at most this share of the budget (1 / it)
RETRY_AFTER_MS = 1000  # what held calls take to be answered, about: the drain budget's half
# A call's weight per byte of its inputs (a character of text, or a token id's four bytes): the
# inputs themselves, and their token ids once tokenized (four bytes a token, at most a token a
# character). Per item of its answer: float32 rows, and their normalized copy.
INPUT_WEIGHT = 5
ROW_BYTES_PER_DIMENSION = 8
ITEM_BYTES = 64  # a Python object per item: a str, a length
# The tokenizer's passing peak per character of a call it tokenizes (its encodings, before they are
# read into ids): 120 MB for 4 MiB of English prose, measured.
TOKENIZING_BYTES_PER_CHAR = 32
# What a refusal for want of memory says holds it.
SERVER_HOLDS = "this server holds {held} bytes of requests and answers"
CLIENT_HOLDS = "this client is sending {held} bytes of bodies at once (weighed)"
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


def pod_memory(limit_bytes: int = 0, memory_max: Path | None = None) -> int:
    """The memory this server may use: ``limit_bytes`` (what the operator passes down), else the
    cgroup v2 limit, else the machine's."""
    if limit_bytes:
        return limit_bytes
    try:
        text = (memory_max or CGROUP_MEMORY_MAX).read_text().strip()
        if text != "max":
            return int(text)
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def frontend_budget(memory_bytes: int, frontends: int, max_message_bytes: int) -> int:
    """Each front end's share: ``memory / SHARE / frontends``, and room for a few of the largest
    requests at least."""
    return max(memory_bytes // SHARE // frontends, MIN_BUDGET_MESSAGES * max_message_bytes)


def grpc_calls(budget: int, max_message_bytes: int, max_concurrent_rpcs: int) -> int:
    """How many RPCs gRPC may take at once: as set, but never more of the largest messages than one
    budget holds (each thrice while it is read: gRPC's buffer, its bytes, the parsed message),
    since gRPC reads each before its handler can weigh it."""
    return max(1, min(max_concurrent_rpcs, budget // (MESSAGE_COPIES * max_message_bytes)))


def growth_bound(budget: int, max_message_bytes: int, tokenizer_threads: int) -> int:
    """How far a front end's resident memory may grow past its idle size: its budget, weighed; what
    gRPC holds unweighed (at most a budget more: :func:`grpc_calls`); the tokenizer's peak on as
    many of the largest calls as it has threads; and a quarter more for the allocator's own."""
    held = 2 * budget + tokenizer_threads * TOKENIZING_BYTES_PER_CHAR * max_message_bytes
    return held + held // 4


def call_weight(nbytes: int, count: int, dimensions: int) -> int:
    """What a call of ``count`` items and ``nbytes`` of inputs holds in a front end, from its arrival
    until it is answered (tokenizing's passing peak aside: ``docs/operations.md``)."""
    return INPUT_WEIGHT * nbytes + count * (ROW_BYTES_PER_DIMENSION * dimensions + ITEM_BYTES)


def over_budget(nbytes: int, held: int, capacity: int, what: str = SERVER_HOLDS) -> EmbedError:
    return EmbedError(
        Failure.REJECTED,
        f"{what.format(held=held)}, and {nbytes} more would pass its {capacity}: retry shortly",
        RETRY_AFTER_MS,
    )


class MemoryBudget:
    """The bytes a front end's calls hold, against its capacity; single-threaded (the event loop's)."""

    def __init__(self, capacity: int, what: str = SERVER_HOLDS) -> None:
        self.capacity = capacity
        self.held = 0
        self._what = what  # who holds them, as a refusal says

    def reserve(self, nbytes: int) -> Reservation:
        """Hold ``nbytes``, or raise REJECTED if they do not fit."""
        reservation = Reservation(self)
        reservation.grow(nbytes)
        return reservation

    def _take(self, nbytes: int) -> None:
        if self.held + nbytes > self.capacity:
            raise over_budget(nbytes, self.held, self.capacity, self._what)
        self.held += nbytes


class ClientShares:
    """Per client, the bytes of its bodies being read, each client within ``share`` of them: a
    client that sends bodies slowly on many connections holds at most that much, whatever the
    budget has left; single-threaded (the event loop's)."""

    def __init__(self, share: int) -> None:
        self.share = share
        self._budgets: dict[str, MemoryBudget] = {}  # of the clients with a body being read
        self._readers: dict[str, int] = {}  # their bodies being read

    @contextlib.contextmanager
    def holding(self, client: str) -> Iterator[Reservation]:
        """A reservation of the client's share, released on leaving."""
        budget = self._budgets.get(client)
        if budget is None:
            budget = self._budgets[client] = MemoryBudget(self.share, CLIENT_HOLDS)
        self._readers[client] = self._readers.get(client, 0) + 1
        try:
            with budget.reserve(0) as reservation:
                yield reservation
        finally:
            self._readers[client] -= 1
            if not self._readers[client]:
                del self._budgets[client], self._readers[client]


class Reservation:
    """What one call, or one part of its path, holds; released once (``with``, or :meth:`release`)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.nbytes = 0

    def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` more (a chunk that arrived, an answer built), or raise REJECTED."""
        self._budget._take(nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        self._budget.held -= self.nbytes
        self.nbytes = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
