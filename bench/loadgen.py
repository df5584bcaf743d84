"""Load generators: open loop (Poisson arrivals at a set rate) and closed loop (N clients).

One asyncio process with ``grpc.aio`` and requests serialized up front (raw bytes in and out,
responses never parsed), so the client takes as little as it can of the CPU it shares with the
server. Every run is bounded in count and in time; outstanding calls are cancelled at the end.
Open-loop latency counts from the scheduled arrival, so a late client cannot hide queueing.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import grpc

from kembed.contract import GRPC_SERVICE, RETRY_PUSHBACK_KEY

EMBED_METHOD = f"/{GRPC_SERVICE}/Embed"
REJECTED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED.name, grpc.StatusCode.UNAVAILABLE.name})
OK = grpc.StatusCode.OK.name
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    item: int  # index into the request list
    scheduled: float  # seconds since the run started
    sent: float
    done: float
    code: str  # grpc status name

    @property
    def latency(self) -> float:
        return self.done - self.scheduled


def poisson_arrivals(rate: float, duration: float, count: int, seed: int) -> list[float]:
    """Arrival times of a Poisson process at ``rate``/s, stopping at ``duration`` s or ``count``."""
    rng = random.Random(seed)
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration and len(times) < count:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _pushback_s(err: grpc.aio.AioRpcError) -> float:
    # grpc-stubs types this as grpc.RpcError's tuple; at run time it is a grpc.aio.Metadata.
    metadata = cast(grpc.aio.Metadata, err.trailing_metadata())
    value = metadata.get(RETRY_PUSHBACK_KEY) if metadata else None
    return float(value) / 1000 if value is not None else 0.05


class _Caller:
    """One channel, one raw-bytes unary method, one clock."""

    def __init__(self, channel: grpc.aio.Channel, requests: Sequence[bytes], timeout: float) -> None:
        # No serializers: pre-serialized bytes go out, and the replies stay bytes (never parsed).
        self._embed = channel.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=None)
        self._requests = requests
        self._timeout = timeout
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def call(self, item: int, scheduled: float) -> tuple[Outcome, float]:
        """The outcome, and how long the server asked us to back off (0 unless rejected)."""
        sent = self.now()
        try:
            await self._embed(self._requests[item % len(self._requests)], timeout=self._timeout)
            code, pushback = OK, 0.0
        except grpc.aio.AioRpcError as err:
            code, pushback = err.code().name, _pushback_s(err)
        return Outcome(item, scheduled, sent, self.now(), code), pushback


async def _bounded(tasks: Sequence[asyncio.Task[T]], grace: float) -> list[T]:
    """Results of the tasks that finish within ``grace`` s; the rest are cancelled and dropped."""
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        task.cancel()
    return [t.result() for t in tasks if t in done]


async def open_loop(
    target: str, requests: Sequence[bytes], rate: float, duration: float, count: int, seed: int, deadline: float
) -> list[Outcome]:
    """Fire one request at each Poisson arrival, whatever is outstanding; wait ``deadline`` s for the last."""
    arrivals = poisson_arrivals(rate, duration, count, seed)
    async with grpc.aio.insecure_channel(target) as channel:
        caller = _Caller(channel, requests, deadline)
        tasks = []
        for item, at in enumerate(arrivals):
            await asyncio.sleep(at - caller.now())  # a negative delay just yields
            tasks.append(asyncio.create_task(caller.call(item, at)))
        return [outcome for outcome, _ in await _bounded(tasks, deadline + 1)]


async def closed_loop(
    target: str, requests: Sequence[bytes], concurrency: int, duration: float, count: int, deadline: float
) -> list[Outcome]:
    """``concurrency`` clients, each sending its next request when the last returns (after the
    server's pushback when rejected), until ``duration`` s or ``count`` requests in all."""
    items = itertools.count()
    outcomes: list[Outcome] = []
    async with grpc.aio.insecure_channel(target) as channel:
        caller = _Caller(channel, requests, deadline)

        async def client() -> None:
            while (item := next(items)) < count and caller.now() < duration:
                outcome, pushback = await caller.call(item, caller.now())
                outcomes.append(outcome)
                await asyncio.sleep(min(pushback, 1.0))

        await _bounded([asyncio.create_task(client()) for _ in range(concurrency)], duration + deadline + 1)
    return sorted(outcomes, key=lambda o: o.scheduled)
