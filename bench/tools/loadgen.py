"""Load generators: open loop (Poisson arrivals at a set rate), closed loop (N clients) and bursts.

Each client process runs asyncio with ``grpc.aio`` and requests serialized up front (raw bytes in
and out, responses never parsed), so the client takes as little as it can of the CPU it shares
with the server. ``in_processes`` runs any of them in K client processes at once, for servers one
Python process cannot saturate. Every run is bounded in count and in time; outstanding calls are
cancelled at the end. Open-loop latency counts from the scheduled arrival, so a late client cannot
hide queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import multiprocessing
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc

from kembed.contract import GRPC_SERVICE, RETRY_PUSHBACK_KEY

EMBED_METHOD = f"/{GRPC_SERVICE}/Embed"
REJECTED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED.name, grpc.StatusCode.UNAVAILABLE.name})
OK = grpc.StatusCode.OK.name
# Channels of one process share a TCP connection unless each keeps its own subchannels; the
# server's SO_REUSEPORT spreads connections (not calls) over its processes, so each counts.
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)
ChannelOptions = Sequence[tuple[str, Any]]
BARRIER_TIMEOUT_S = 120.0  # client processes start (spawn and import) within this
T = TypeVar("T")


@dataclass(frozen=True)
class CallRecord:
    """One call, answered or not: when, and with which code."""

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

    def __init__(self, channel: grpc.aio.Channel, requests: Sequence[bytes], timeout: float, t0: float) -> None:
        # No serializers: pre-serialized bytes go out, and the replies stay bytes (never parsed).
        self._embed = channel.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=None)
        self._requests = requests
        self._timeout = timeout
        self.t0 = t0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def call(self, item: int, scheduled: float) -> tuple[CallRecord, float]:
        """The outcome, and how long the server asked us to back off (0 unless rejected)."""
        sent = self.now()
        try:
            await self._embed(self._requests[item % len(self._requests)], timeout=self._timeout)
            code, pushback = OK, 0.0
        except grpc.aio.AioRpcError as err:
            code, pushback = err.code().name, _pushback_s(err)
        return CallRecord(item, scheduled, sent, self.now(), code), pushback


async def bounded(tasks: Sequence[asyncio.Task[T]], grace: float) -> list[T]:
    """Results of the tasks that finish within ``grace`` s; the rest are cancelled and dropped."""
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        task.cancel()
    return [t.result() for t in tasks if t in done]


@contextlib.asynccontextmanager
async def _callers(
    target: str, requests: Sequence[bytes], deadline: float, channels: int, options: ChannelOptions = ()
) -> AsyncIterator[list[_Caller]]:
    """``channels`` connected channels (each its own TCP connection, with ``options`` besides)
    sharing one clock, started once every client process is connected too, so connection setup
    stays out of the figures."""
    async with contextlib.AsyncExitStack() as stack:
        opened = [
            await stack.enter_async_context(grpc.aio.insecure_channel(target, options=(*CHANNEL_OPTIONS, *options)))
            for _ in range(channels)
        ]
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in opened)), deadline)
        await all_processes_ready()
        t0 = time.perf_counter()
        yield [_Caller(c, requests, deadline, t0) for c in opened]


async def open_loop(
    target: str,
    requests: Sequence[bytes],
    rate: float,
    duration: float,
    count: int,
    seed: int,
    deadline: float,
    retry_after: float | None = None,
    give_up: float = math.inf,
    channels: int = 1,
    options: ChannelOptions = (),
) -> list[CallRecord]:
    """Fire one request at each Poisson arrival, whatever is outstanding, over ``channels``
    channels in turn (a connection pool), each with ``options`` (gRPC's own retry policy, say: its
    attempts are one call here); wait ``deadline`` s for the last.

    With ``retry_after``, a rejected request is sent again that many seconds later, whatever the
    server's pushback says (a retry storm), until it is answered otherwise, or ``give_up`` s have
    passed since its arrival; every attempt is an outcome."""
    arrivals = poisson_arrivals(rate, duration, count, seed)
    outcomes: list[CallRecord] = []
    async with _callers(target, requests, deadline, channels, options) as callers:
        clock = callers[0]  # they share one

        async def send(item: int, arrival: float) -> None:
            caller = callers[item % channels]
            at = arrival
            stop_at = arrival + give_up
            while True:
                outcome, _ = await caller.call(item, at)
                outcomes.append(outcome)
                if retry_after is None or outcome.code not in REJECTED or caller.now() + retry_after > stop_at:
                    return
                await asyncio.sleep(retry_after)
                at = caller.now()  # a retry's latency counts from its own send

        tasks = []
        for item, at in enumerate(arrivals):
            await asyncio.sleep(at - clock.now())  # a negative delay just yields
            tasks.append(asyncio.create_task(send(item, at)))
        await bounded(tasks, deadline + 1)  # retries stop at ``duration``: now
    return sorted(outcomes, key=lambda o: o.scheduled)


async def closed_loop(
    target: str,
    requests: Sequence[bytes],
    concurrency: int,
    duration: float,
    count: int,
    deadline: float,
    channels: int = 1,
    pushback: bool = True,
) -> list[CallRecord]:
    """``concurrency`` clients over ``channels`` channels, each sending its next request when the
    last returns (after the server's pushback when rejected, unless ``pushback`` is False: a client
    that ignores it), until ``duration`` s or ``count`` requests in all."""
    items = itertools.count()
    outcomes: list[CallRecord] = []
    async with _callers(target, requests, deadline, channels) as callers:

        async def client(caller: _Caller) -> None:
            while (item := next(items)) < count and caller.now() < duration:
                outcome, told = await caller.call(item, caller.now())
                outcomes.append(outcome)
                await asyncio.sleep(min(told, 1.0) if pushback else 0.0)

        clients = [asyncio.create_task(client(callers[i % channels])) for i in range(concurrency)]
        await bounded(clients, duration + deadline + 1)
    return sorted(outcomes, key=lambda o: o.scheduled)


async def burst(
    target: str, request: bytes, calls: int, rounds: int, deadline: float, channels: int = 1
) -> list[list[CallRecord]]:
    """``rounds`` bursts, one after the other, of ``calls`` copies of ``request`` fired at once;
    each outcome's latency counts from its burst's start (in every client process alike). Before
    the next burst the client waits out the longest pushback the last one was given, as a client
    that respects it does."""
    results: list[list[CallRecord]] = []
    async with _callers(target, [request], deadline, channels) as callers:
        for _ in range(rounds):
            await all_processes_ready()
            start = callers[0].now()
            tasks = [asyncio.create_task(callers[i % channels].call(i, start)) for i in range(calls)]
            answered = await bounded(tasks, deadline + 1)
            results.append([outcome for outcome, _ in answered])
            await asyncio.sleep(max((pushback for _, pushback in answered), default=0.0))
    return results


# --- several client processes -------------------------------------------------------------------

_barrier: Barrier | None = None  # set in each client process by in_processes, None in a single process


def _join(barrier: Barrier, nice: int) -> None:
    global _barrier
    _barrier = barrier
    os.nice(nice)
    if nice > 0:
        _autogroup_below(nice)


def _autogroup_below(nice: int) -> None:
    """This process in a scheduling group of its own at ``nice``, where the kernel groups by session
    (``/proc/sys/kernel/sched_autogroup_enabled``): there a niceness weighs only within a session,
    and a busy load generator would take as much CPU as the server's session, niced or not."""
    try:
        os.setsid()
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:  # no autogroups (the niceness alone counts), or a session leader already
        pass


async def all_processes_ready() -> None:
    """Wait until every client process of ``in_processes`` gets here (at once: no-op)."""
    if _barrier is not None:
        await asyncio.to_thread(_barrier.wait, BARRIER_TIMEOUT_S)


def _run(job: Callable[..., Coroutine[Any, Any, T]], kwargs: dict[str, Any]) -> tuple[T, float]:
    """In a client process: the job's result and the CPU seconds this process used for it."""
    start = time.process_time()
    result = asyncio.run(job(**kwargs))
    return result, time.process_time() - start


def in_processes(
    job: Callable[..., Coroutine[Any, Any, T]], kwargs: Sequence[dict[str, Any]], nice: int = 0
) -> tuple[list[T], float]:
    """``job(**kwargs[i])`` in ``len(kwargs)`` fresh client processes at niceness ``nice`` (added
    to ours), started together; their results, and the CPU seconds they used in all. Jobs are
    module-level coroutines (they must pickle); clocks are CLOCK_MONOTONIC, so
    their times compare across processes."""
    context = multiprocessing.get_context("spawn")  # grpc's state must not be forked
    barrier = context.Barrier(len(kwargs))
    initargs = (barrier, nice)
    with ProcessPoolExecutor(len(kwargs), mp_context=context, initializer=_join, initargs=initargs) as pool:
        # One job per process: each blocks at the barrier until all have started.
        done = list(pool.map(_run, [job] * len(kwargs), kwargs))
    return [result for result, _ in done], sum(cpu for _, cpu in done)


def split(total: int, parts: int) -> list[int]:
    """``total`` shared out over ``parts`` as evenly as integers allow."""
    return [total // parts + (i < total % parts) for i in range(parts)]
