"""The stamping emulator on a bad day: failed writes, lost answers, slow answers, watches that end
and expire, and watch gaps (a resource's watches down while something changes, then expired).

Faults hit every client but the tests' own (told apart by their User-Agent), so a test can always
see the truth. They are set at run time (``emulator.faults = Faults(...)``) and counted in
``emulator.injected``, so a test can show that the faults it claims to survive really happened.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp.web
import attrs
from kmock._internal import rendering

from tests.operator.emulator import _MUTATIONS, TEST_AGENT, StampingEmulator

_REASONS = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass(frozen=True)
class Faults:
    write_share: float = 0.0  # share of creates, patches and deletes answered with an error
    lost_answer_share: float = 0.0  # share of writes done and then answered 500 (an answer lost after commit)
    statuses: tuple[int, ...] = (409, 500, 503, 429)  # drawn evenly; 429 carries Retry-After
    retry_after_s: int = 1
    delay_s: float = 0.0  # added to every answer
    watch_lifetime_s: float = 0.0  # watch streams end after 0.5-1x this (0: never)
    gone_share: float = 0.0  # share of resumed watches (with a resourceVersion) answered 410 Gone
    # Plurals whose watches are down: open ones end, new ones wait for the gap to close and are then
    # answered 410 Gone, so the client re-lists and hears of nothing that happened in between.
    gap: tuple[str, ...] = ()
    # kopf exits when its leader-election keepalive fails (in a cluster the pod restarts; the
    # SIGKILL test covers that), which would end a test instead of exercising the operator.
    spared: tuple[str, ...] = ("clusterkopfpeerings",)


@attrs.define(kw_only=True)
class FaultyEmulator(StampingEmulator):
    faults: Faults = attrs.field(factory=Faults)
    injected: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    _rng: random.Random = attrs.field(factory=lambda: random.Random(10), init=False)

    @staticmethod
    def _faulted(request: rendering.Request) -> bool:
        return request.headers.get("User-Agent") != TEST_AGENT

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        faults = self.faults
        if not self._faulted(request):
            return await super()._handle(request)
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        spared = request.resource is not None and request.resource.plural in faults.spared
        if request.action not in _MUTATIONS or spared:
            return await super()._handle(request)
        if self._rng.random() < faults.write_share:
            return self._error(self._rng.choice(faults.statuses))
        response = await super()._handle(request)
        if self._rng.random() < faults.lost_answer_share:
            self.injected["lost answer"] += 1
            return self._error(500)
        return response

    def _error(self, status: int) -> aiohttp.web.StreamResponse:
        self.injected[str(status)] += 1
        body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": status}
        body |= {"reason": _REASONS[status], "message": f"injected {status}"}
        headers = {"Retry-After": str(self.faults.retry_after_s)} if status == 429 else {}
        return aiohttp.web.json_response(body, status=status, headers=headers)

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        faults = self.faults
        if not self._faulted(request):
            async for item in super()._serve_watch(request):
                yield item
            return
        plural = request.resource.plural if request.resource is not None else None
        gapped = plural in faults.gap
        if gapped:  # the headers now, the rest once the gap closes
            yield b""
            self.injected["watch held"] += 1
            while plural in self.faults.gap:  # noqa: ASYNC110 (faults are set from the test's thread)
                await asyncio.sleep(0.1)
        if request.params.get("resourceVersion") and (gapped or self._rng.random() < faults.gone_share):
            self.injected["410"] += 1
            yield b""
            yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
            return
        # A pump task, so that waiting with a timeout never cancels the stream itself.
        queue: asyncio.Queue[rendering.Payload | None] = asyncio.Queue()
        pump = asyncio.create_task(self._pump(super()._serve_watch(request), queue))
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while True:
                if deadline is None and self.faults.watch_lifetime_s:  # faults may start mid-stream
                    deadline = loop.time() + self.faults.watch_lifetime_s * self._rng.uniform(0.5, 1.0)
                if (deadline is not None and loop.time() >= deadline) or plural in self.faults.gap:
                    self.injected["watch ended"] += 1
                    return
                try:  # a short wait, so that a gap opening ends the stream at once
                    item = await asyncio.wait_for(queue.get(), 0.2)
                except TimeoutError:
                    continue
                if item is None:
                    return
                yield item
        finally:
            pump.cancel()

    @staticmethod
    async def _pump(stream: AsyncIterator[rendering.Payload], queue: asyncio.Queue[rendering.Payload | None]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            queue.put_nowait(None)
