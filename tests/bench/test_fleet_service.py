"""bench.fleet's ClusterIP Service: a pod picked per connection, held for the connection's life;
and the peers' policies the fleet bench runs beside the operator's."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from aiohttp import web

from bench.fleet import policies, run
from bench.fleet.service import RETRY_COUNT_HEADER, ClusterIP, RestProcess, pick
from kembed.config.settings import Settings
from kembed.v1 import embedder_pb2


@dataclass
class Pod:
    name: str
    address: str = ""


def test_pick_is_one_of_the_ready_endpoints_or_none() -> None:
    rng = random.Random(1)
    assert pick([], rng) is None
    assert {pick(["a", "b"], rng) for _ in range(50)} == {"a", "b"}


async def _named_server(name: bytes) -> tuple[asyncio.Server, str]:
    """Answers every line with its own name: which pod a connection reached."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            writer.write(name + b"\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"?\n")
    await writer.drain()
    return (await reader.readline()).strip()


def test_a_connection_stays_on_the_pod_it_reached_and_new_ones_reach_a_pod_added() -> None:
    async def scenario() -> None:
        old_server, old_address = await _named_server(b"old")
        new_server, new_address = await _named_server(b"new")
        pods = [Pod("old", old_address)]
        service: ClusterIP[Pod] = ClusterIP(lambda: pods, lambda p: p.address, random.Random(3))
        host, port = (await service.start(lambda: 1.0)).split(":")
        held = await asyncio.open_connection(host, int(port))
        assert await _ask(*held) == b"old"
        pods.append(Pod("new", new_address))
        assert {await _ask(*held) for _ in range(20)} == {b"old"}  # per connection, not per call
        reached = set()
        for _ in range(20):
            connection = await asyncio.open_connection(host, int(port))
            reached.add(await _ask(*connection))
            connection[1].close()
        assert reached == {b"old", b"new"}
        assert service.first_connection == {"old": 1.0, "new": 1.0}
        held[1].close()
        await service.close()
        old_server.close()
        new_server.close()

    asyncio.run(scenario())


def test_a_service_without_endpoints_closes_the_connection() -> None:
    async def scenario() -> None:
        service: ClusterIP[Pod] = ClusterIP(list, lambda p: p.address, random.Random(3))
        host, port = (await service.start(lambda: 0.0)).split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await reader.read() == b""
        writer.close()
        await service.close()

    asyncio.run(scenario())


def test_the_peers_policies_scale_on_namespace_totals() -> None:
    by_name = {p.name: p for p in policies.policies(run.SLO_MS, capacity_per_s=20.0)}
    keda, knative = by_name["keda_waiting5"], by_name["knative70"]
    assert keda.external == {policies.WAITING_QUERY: 5.0} and keda.behavior is None
    assert knative.external == {policies.IN_FLIGHT_QUERY: 0.7 * 20.0 * 1.0}  # 0.7 of 20/s x the 1 s SLO
    assert "kembed_running_requests" in policies.IN_FLIGHT_QUERY.format(ns="x")


def test_the_connection_age_is_compressed_with_the_controller() -> None:
    default_ms = Settings.model_fields["max_connection_age_ms"].default
    setup = run.Setup(policies.rendered(run.SLO_MS), None, None, [], [], "", None, 0, run.SLO_MS)  # type: ignore[arg-type]
    assert int(run.fleet_settings(setup)["max_connection_age_ms"]) == max(1000, int(default_ms / run.COMPRESSION))


def test_a_rest_client_process_sends_the_call_as_the_openai_api_and_reads_its_outcome() -> None:
    """What the REST client process sends (the texts and truncate, as the gRPC request has them) and
    how it reads an answer: 200 answered, a refusal with its Retry-After, anything else lost."""
    bodies: list[dict[str, object]] = []
    answers = [
        web.Response(status=200),
        web.Response(status=429, headers={"Retry-After": "1", "retry-after-ms": "250"}),
        web.Response(status=400),
    ]

    retry_counts: list[str | None] = []

    async def embeddings(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        retry_counts.append(request.headers.get(RETRY_COUNT_HEADER))
        return answers[len(bodies) - 1]

    async def scenario() -> list[tuple[str, float]]:
        app = web.Application()
        app.router.add_post("/v1/embeddings", embeddings)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = RestProcess(f"http://127.0.0.1:{port}")
        request = embedder_pb2.EmbedRequest(texts=["a long text"], truncate=True).SerializeToString()
        outcomes = [await client.call(request, 10.0, attempt) for attempt in range(len(answers))]
        await client.close()
        await runner.cleanup()
        return outcomes

    assert asyncio.run(scenario()) == [("ok", 0.0), ("refused", 0.25), ("lost: REST 400", 0.0)]
    assert bodies[0] == {"input": ["a long text"], "truncate": True}
    assert retry_counts == ["0", "1", "2"]  # the retry marker, as the SDK sends it
