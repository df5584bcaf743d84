"""The REST edge's connections: at most a cap of them, and which one is closed to make room.

Past the cap, room is made by the client (an address, as :func:`~kembed.frontend.pushback.rest_client`
keys it) holding the most connections: a client that opens connections as fast as they are closed
then churns its own, never a neighbour's with one connection (``docs/decisions/hostile-clients.md``).
Among clients tied at the most, the one whose idle connection has been idle the longest gives it up,
the newcomer's client last: a newcomer is never closed for room while a client tied with it holds an
idle connection (sixteen addresses with an idle connection each otherwise closed every newcomer).
Of that client's connections the one closed is the one idle the longest if idle ``IDLE_GRACE_S`` (a
new connection gets that long to send its request), else the one sending its request the longest,
else its newest: the newcomer itself when its own client gives one up. A connection working on an
accepted call is never closed for room.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web import RequestHandler

from kembed.frontend.pushback import rest_client

IDLE_GRACE_S = 1.0  # past the connection cap, an idle connection is closed first only once idle this long
AGE_JITTER = 0.1  # a connection's age is the setting's within this share, as gRPC's core draws its own


@dataclass
class _Client:
    """One client's open connections, each in one of these, in the order it entered it."""

    key: str
    idle: dict[RequestHandler, float] = field(default_factory=dict)  # since when
    reading: dict[RequestHandler, None] = field(default_factory=dict)
    working: set[RequestHandler] = field(default_factory=set)

    def held(self) -> int:
        return len(self.idle) + len(self.reading) + len(self.working)

    def closable(self) -> bool:
        return bool(self.idle or self.reading)

    def idle_since(self) -> float:
        """When its connection idle the longest became idle (infinity: none is idle)."""
        return next(iter(self.idle.values()), math.inf)

    def victim(self, now: float) -> RequestHandler:
        """The connection of this client's to close for room (it has one that is not working)."""
        oldest = next(iter(self.idle.items()), None)
        if oldest is not None and now - oldest[1] >= IDLE_GRACE_S:
            return oldest[0]
        if self.reading:
            return next(iter(self.reading))
        return next(reversed(self.idle))

    def forget(self, handler: RequestHandler) -> None:
        self.idle.pop(handler, None)
        self.reading.pop(handler, None)
        self.working.discard(handler)


class Connections(web.Server):
    """aiohttp's low-level server, holding at most ``limit`` connections, room made as the module
    says. A client that leaves cancels its handler, so its call is dropped. A connection is
    :meth:`aged` once open ``max_age_s``, give or take ``AGE_JITTER``. Malformed requests are
    answered by ``error``; ``kwargs`` go to each connection's :class:`~aiohttp.web.RequestHandler`."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Any],
        *,
        limit: int,
        error: Callable[[int, str], web.Response],
        max_age_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, handler_cancellation=True, **kwargs)
        self._limit = limit
        self._error = error
        self._max_age_s = max_age_s
        self._aged_at: dict[RequestHandler, float] = {}  # every open connection's
        self._handler_args = kwargs
        self._clients: dict[str, _Client] = {}  # those with an open connection
        self._client_of: dict[RequestHandler, _Client] = {}

    def __call__(self) -> RequestHandler:
        return _Connection(self, self._error, loop=asyncio.get_running_loop(), **self._handler_args)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        now = asyncio.get_running_loop().time()
        peer = transport.get_extra_info("peername")
        key = rest_client(peer[0]) if isinstance(peer, tuple) else ""
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _Client(key)
        self._client_of[handler] = client
        client.idle[handler] = now
        self._aged_at[handler] = now + self._max_age_s * random.uniform(1 - AGE_JITTER, 1 + AGE_JITTER)
        if len(self._client_of) > self._limit:
            self._close_one(client, now)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._forget(handler)
        self._aged_at.pop(handler, None)

    def aged(self, handler: RequestHandler) -> bool:
        return asyncio.get_running_loop().time() >= self._aged_at.get(handler, math.inf)

    def reading(self, handler: RequestHandler) -> None:
        client = self._client_of.get(handler)
        if client is not None and client.idle.pop(handler, None) is not None:
            client.reading[handler] = None

    def working(self, handler: RequestHandler) -> None:
        client = self._client_of.get(handler)
        if client is not None and client.reading.pop(handler, False) is None:
            client.working.add(handler)

    def done(self, handler: RequestHandler) -> None:
        """Its request answered (or refused): idle from now, if it is still open."""
        client = self._client_of.get(handler)
        if client is not None and (client.reading.pop(handler, False) is None or handler in client.working):
            client.working.discard(handler)
            client.idle[handler] = asyncio.get_running_loop().time()

    def _forget(self, handler: RequestHandler) -> None:
        client = self._client_of.pop(handler, None)
        if client is None:
            return
        client.forget(handler)
        if not client.held():
            del self._clients[client.key]

    def _close_one(self, newcomers: _Client, now: float) -> None:
        """Close a connection of the client holding the most; of those tied, of the one idle the
        longest, the newcomer's last (the newcomer's is closable)."""
        holder = max(
            (c for c in self._clients.values() if c.closable()),
            key=lambda c: (c.held(), c is not newcomers, -c.idle_since()),
        )
        victim = holder.victim(now)
        self._forget(victim)
        victim.force_close()


class _Connection(RequestHandler):
    """One connection; a request aiohttp cannot parse is answered by the edge, not by aiohttp's
    text/plain page and traceback."""

    def __init__(self, manager: Connections, error: Callable[[int, str], web.Response], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._error = error

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        return self._error(status, message or (type(exc).__name__ if exc else "unknown"))
