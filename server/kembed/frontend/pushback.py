"""Refusals paced per client, so that a client retrying faster than it is told costs the engine's
cores no more than its share of refusals (``docs/decisions/paced-refusals.md``).

Every call is decided when it arrives: admitted, and then answered within its budget, or refused at
once. Nothing is held to be decided later. A refusal costs the front end about what a gRPC echo
costs (a third of a millisecond on the 2-core test machine), and a client that ignores its pushback
and calls again at once, as a retry storm does, would otherwise spend a core on them. So each client
has a token bucket of refusals: ``burst`` at once (a burst of hundreds of calls is refused as fast
as the front end reads it), then ``rate`` a second. A refusal past that is still decided at once,
but its answer is sent when the client's bucket has room again, at most ``MAX_PACE_S`` later: a
client that retries when it hears the answer then calls at ``rate``. A refusal weighs its bytes
too (:func:`refusal_weight`): a client refused for large bodies is paced on what reading them
costs. A paced answer is a timer (:class:`PacedAnswers`): the edge lets go of everything the call
held (its call slot, its connection's, its memory) before it waits, and a front end holds at most
``MAX_PACED`` of them; past that a refusal is answered at once. Admitted calls are never paced: a stranger sharing the
connection of a retrying client (a pool, a mesh sidecar) is admitted at once when the engine has
room.

A client is whatever key the edge gives: on gRPC the connection, on REST the client's address
(:func:`rest_client`), so opening a new connection per call does not evade the pacing. Buckets are
bounded in number (``MAX_CLIENTS``); past that, clients without one share one bucket
(``kembed_refusals_shared_total`` counts the refusals charged to it): pacing coarsens, it never turns
off.

:class:`RefusalPacer` is pure (the clock is injected).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kembed.domain.errors import EmbedError, Failure
from kembed.policy.admission import MAX_PUSHBACK_MS

# The longest a refusal's answer is deferred, the longest pushback: only a bound, since a client
# whose callers wait for their answers is paced by far less (its callers over the rate).
MAX_PACE_S = MAX_PUSHBACK_MS / 1000
MAX_CLIENTS = 4096  # buckets kept at most: about 150 bytes each
# Paced answers a front end holds at once: a closed loop of this many callers ignoring their pushback.
# Each is a waiting call holding no request: its task, its context, gRPC's call or aiohttp's
# request, of the order of 10 KiB (estimated), so about 10 MiB at most. gRPC's cap on calls is
# raised by this many.
MAX_PACED = 1024
# A refused call's bytes weigh as refusals: reading, word-counting and parsing this many costs a
# front end about what a refusal does (a 925 KB body of 1,024 texts: 1.3 ms of yajl, about 3 ms of
# word counts and 1 ms of reading, on the loaded 2-core EPYC; a refusal is 0.4 ms), so a client
# refused for large bodies is paced on what they cost, not on their count (1,192 bodies of 925 KB
# refused at 79.5 a second were never paced).
PACE_BYTES = 64 * 1024
SHARED = object()  # the key of the bucket clients share once there is no room for one of their own


@dataclass
class _Bucket:
    tokens: float  # refusals the client may still have answered at once; below 0, the debt paced
    updated: float  # monotonic seconds


class RefusalPacer:
    """Each client's refusals: how long the answer to the latest one is deferred."""

    def __init__(
        self,
        rate: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_CLIENTS,
        on_shared: Callable[[], None] = lambda: None,
    ) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._max_clients = max_clients
        self._on_shared = on_shared  # a refusal was charged to the shared bucket
        self._buckets: dict[Hashable, _Bucket] = {}
        self._sweep_at = -math.inf  # no bucket is full again before this: a sweep would find none

    def refused(self, client: Hashable, weight: float = 1.0) -> float:
        """A call of this client was refused now, weighing ``weight`` refusals (its bytes': see
        :func:`refusal_weight`): the seconds its answer waits (0: at once)."""
        now = self._clock()
        bucket = self._bucket(client, now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.updated) * self._rate) - weight
        bucket.updated = now
        if bucket.tokens >= 0:
            return 0.0
        bucket.tokens = max(bucket.tokens, -MAX_PACE_S * self._rate)  # the debt paced is bounded
        return -bucket.tokens / self._rate

    def in_debt(self, client: Hashable) -> bool:
        """Whether the client's refusals are being paced now: it has been refused past its burst,
        faster than its rate (it ignores its pushback)."""
        bucket = self._buckets.get(client)
        return bucket is not None and bucket.tokens + (self._clock() - bucket.updated) * self._rate < 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, client: Hashable, now: float) -> _Bucket:
        """The client's bucket: its own, a new full one, or the shared one when the table is full
        of clients that refused recently."""
        buckets = self._buckets
        if (bucket := buckets.get(client)) is not None:
            return bucket
        if len(buckets) >= self._max_clients and now >= self._sweep_at:
            self._forget_full(now)
        if len(buckets) >= self._max_clients:
            self._on_shared()
            return buckets.setdefault(SHARED, _Bucket(self._burst, now))
        bucket = buckets[client] = _Bucket(self._burst, now)
        return bucket

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled: forgetting them changes nothing."""
        full_at = {key: b.updated + (self._burst - b.tokens) / self._rate for key, b in self._buckets.items()}
        for key, at in full_at.items():
            if at <= now and key is not SHARED:
                del self._buckets[key]
        self._sweep_at = min((at for key, at in full_at.items() if at > now), default=now)


class PacedAnswers:
    """The answers to refusals a front end defers: each a timer, at most ``limit`` at once (past
    it, answered at once), all answered at once from a drain on."""

    def __init__(
        self, pacer: RefusalPacer, limit: int = MAX_PACED, on_paced: Callable[[], None] = lambda: None
    ) -> None:
        self._pacer = pacer
        self._limit = limit
        self._on_paced = on_paced  # an answer was deferred
        self._draining = asyncio.Event()
        self.held = 0  # answers waiting now

    def refusal(self, client: Hashable, error: EmbedError) -> Refusal:
        """``error`` (REJECTED), refusing a call of ``client``, as a value whose answer is paced here."""
        return Refusal(error.message, error.retry_after_ms, client, self)

    def in_debt(self, client: Hashable) -> bool:
        """Whether ``client``'s refusals are being paced: it calls again faster than it is told."""
        return self._pacer.in_debt(client)

    async def refused(self, client: Hashable, weight: float = 1.0) -> None:
        """A call of this client was refused: return when its answer may be sent. The caller holds
        nothing of the call's by now but what answering it needs."""
        delay = self._pacer.refused(client, weight)
        if not delay or self._draining.is_set() or self.held >= self._limit:
            return
        self._on_paced()
        self.held += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._draining.wait(), delay)
        finally:
            self.held -= 1

    def drain(self) -> None:
        """Answer every paced refusal now, and pace none from here on: a drain waits for no timer."""
        self._draining.set()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call refused for load (REJECTED), as the value the service returns: what its answer says,
    and when it may be sent. It holds nothing of the call's (a raised error's traceback would hold
    its request): the edge lets go of all the call held, awaits :meth:`answerable`, then answers."""

    message: str
    retry_after_ms: int
    client: Hashable
    answers: PacedAnswers

    async def answerable(self, weight: float) -> None:
        """Return when the answer may be sent, the call weighing ``weight`` refusals (its bytes on
        the wire: :func:`refusal_weight`)."""
        await self.answers.refused(self.client, weight)

    @property
    def error(self) -> EmbedError:
        return EmbedError(Failure.REJECTED, self.message, self.retry_after_ms)


def refusal_weight(nbytes: int) -> float:
    """What a refused call of ``nbytes`` weighs against its client's refusals: its bytes, and at
    least one (a burst of calls of a few kilobytes is a burst of as many refusals)."""
    return max(1.0, nbytes / PACE_BYTES)


@functools.lru_cache(maxsize=4096)  # parsed once per address, not per call (4-13 µs each)
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
