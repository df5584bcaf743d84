"""The offered traffic: Poisson arrivals along the profile's segments, the requests, and the clients
that send them to the fleet (held connections as a ClusterIP gives them, or spread per call)."""

from __future__ import annotations

import asyncio
import collections
import random
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import cast

import grpc

from bench.fleet import judge as fleet_judge
from bench.fleet.judge import Call, Segment
from bench.fleet.pods import Fleet, Replica
from bench.fleet.service import ClusterIP, GrpcProcess, RestProcess
from bench.tools import workload
from bench.tools.loadgen import EMBED_METHOD, REJECTED
from kembed.contract import RETRY_ATTEMPT_KEY, RETRY_PUSHBACK_KEY
from kembed.v1 import embedder_pb2

CALL_TIMEOUT_S = 30.0


def arrivals(segments: Sequence[Segment], capacity: float, seed: int) -> list[float]:
    """A Poisson process whose rate follows the profile (thinning a homogeneous one)."""
    rng = random.Random(seed)
    peak = capacity * max(s.level_to for s in segments)
    end, t, times = segments[-1].end, 0.0, []
    while (t := t + rng.expovariate(peak)) < end:
        if rng.random() < capacity * fleet_judge.level_at(segments, t) / peak:
            times.append(t)
    return times


def requests(count: int = 512) -> list[bytes]:
    """One text per call from the bench workload (interactive, the default priority)."""
    texts = workload.load().texts[:count]
    return [embedder_pb2.EmbedRequest(texts=[t], truncate=True).SerializeToString() for t in texts]


class Balancer:
    """Per call, one ready pod at random (kube-proxy's choice among a Service's ready endpoints, made
    per call); ``first_connection``: when each pod got its first call."""

    def __init__(self, fleet: Fleet, seed: int) -> None:
        self._fleet = fleet
        self._rng = random.Random(seed)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.first_connection: dict[str, float] = {}
        self.losses: collections.Counter[str] = collections.Counter()  # calls lost, by why

    async def call(self, request: bytes, attempt: int = 0) -> tuple[str, float]:
        """The outcome and the pushback in seconds; ``attempt``: the attempts sent before this one."""
        endpoints = self._fleet.endpoints()
        if not endpoints:
            return "refused", 0.0  # a Service without endpoints refuses the connection
        replica = self._rng.choice(endpoints)
        self.first_connection.setdefault(replica.name, self._fleet.now())
        channel = self._channels.get(replica.name)
        if channel is None:
            channel = self._channels[replica.name] = grpc.aio.insecure_channel(replica.server.grpc_target)
        embed = channel.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=None)
        metadata = ((RETRY_ATTEMPT_KEY, str(attempt)),) if attempt else None
        try:
            await embed(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
            return "ok", 0.0
        except grpc.aio.AioRpcError as err:
            if (outcome := _outcome(err))[0] == "lost":
                self.losses[f"lost: gRPC {err.code().name} {err.details()}"] += 1
            return outcome

    async def close(self) -> None:
        await asyncio.gather(*(c.close(None) for c in self._channels.values()))


class Connected:
    """Per connection, as a ClusterIP Service balances: ``grpc_clients`` client processes on gRPC and
    ``rest_clients`` on REST, each call made by one of them at random, on the connections it holds."""

    def __init__(self, fleet: Fleet, seed: int, grpc_clients: int, rest_clients: int) -> None:
        self._fleet = fleet
        self._rng = random.Random(seed)
        endpoints: Callable[[], list[Replica]] = fleet.endpoints
        self._grpc = ClusterIP(endpoints, lambda r: r.server.grpc_target, random.Random(seed + 1))
        self._rest = ClusterIP(
            endpoints, lambda r: urllib.parse.urlsplit(r.server.rest_url).netloc, random.Random(seed + 2)
        )
        self._counts = (grpc_clients, rest_clients)
        self._clients: list[GrpcProcess | RestProcess] = []
        self.losses: collections.Counter[str] = collections.Counter()  # calls lost, by why

    async def start(self) -> Connected:
        grpc_target, rest_target = await self._grpc.start(self._fleet.now), await self._rest.start(self._fleet.now)
        self._clients = [GrpcProcess(grpc_target) for _ in range(self._counts[0])]
        self._clients += [RestProcess(f"http://{rest_target}") for _ in range(self._counts[1])]
        return self

    @property
    def first_connection(self) -> dict[str, float]:
        firsts: dict[str, float] = {}
        for name, at in [*self._grpc.first_connection.items(), *self._rest.first_connection.items()]:
            firsts[name] = min(at, firsts.get(name, at))
        return firsts

    async def call(self, request: bytes, attempt: int = 0) -> tuple[str, float]:
        """The outcome and the pushback in seconds; ``attempt``: the attempts sent before this one.
        (A retry goes from whichever client process: they share the one call's clock, not its pod.)"""
        answer = await self._rng.choice(self._clients).call(request, CALL_TIMEOUT_S, attempt)
        if isinstance(answer, grpc.aio.AioRpcError):
            outcome, pushback = _outcome(answer)
            if outcome == "lost":
                outcome = f"lost: gRPC {answer.code().name} {answer.details()}"
        else:
            outcome, pushback = answer
        if outcome.startswith("lost"):
            self.losses[outcome] += 1
            return "lost", 0.0
        return outcome, pushback

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients))
        await self._grpc.close()
        await self._rest.close()


def _outcome(err: grpc.aio.AioRpcError) -> tuple[str, float]:
    """A refusal is kembed's (a rejecting code with its pushback, returned in seconds); anything else
    lost an accepted call."""
    metadata = cast(grpc.aio.Metadata, err.trailing_metadata())
    pushback = None if metadata is None else metadata.get(RETRY_PUSHBACK_KEY)
    if err.code().name in REJECTED and pushback is not None:
        return "refused", int(pushback) / 1000
    return "lost", 0.0


async def offer(
    balancer: Balancer | Connected, fleet: Fleet, times: Sequence[float], bodies: Sequence[bytes], retries: int = 0
) -> tuple[list[Call], int]:
    """Every arrival sent at its time, whatever is outstanding, a refused one again after its
    pushback up to ``retries`` times; latency from the scheduled time. Also the attempts sent."""
    calls: list[Call] = []
    attempts = 0

    async def one(i: int, at: float) -> None:
        nonlocal attempts
        for attempt in range(retries + 1):
            attempts += 1
            outcome, pushback = await balancer.call(bodies[i % len(bodies)], attempt)
            if outcome != "refused" or attempt == retries:
                break
            await asyncio.sleep(pushback)
        calls.append(Call(at, fleet.now() - at, outcome))

    tasks = []
    for i, at in enumerate(times):
        await asyncio.sleep(at - fleet.now())
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.wait(tasks, timeout=CALL_TIMEOUT_S * (retries + 1) + 5)
    return sorted(calls, key=lambda c: c.scheduled), attempts
