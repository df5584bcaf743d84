"""Issue 57's reproductions, as an attacker runs them: ``python -m bench.serving.attacks``.

One server (the real model) per setting: ``default`` (the server's defaults), ``small``
(``KEMBED_MEMORY_LIMIT_BYTES=2147483648``: 85 gRPC call slots and a 512 MiB budget at one front
end) and ``capped`` (the same and ``KEMBED_MAX_REST_CONNECTIONS=16``), all with
``KEMBED_COMPILE=off`` (the attacks do not depend on the forward; a compile would take a minute of
the shared cores). For each attack, two phases of
``--phase-s``: the bystander alone (*before*), then beside the attacker (*during*). The bystander
is 4 gRPC callers of one short text on a channel of their own, and a REST caller opening a new
connection for each call from another address (127.0.0.2), each call with a 10 s deadline: per
phase its calls, its OK share and its OK calls/s, for each kind. The attackers, each in a process
of its own:

1. ``silent``: twice as many gRPC ``Embed`` calls as the front end has slots, over 7 connections,
   each sending its head and never its message, reopened when cut;
2. ``heads``: REST heads declaring the largest body, never sent, on as many connections as fill
   the memory budget 1.25 times at twice their length, each reopened when cut;
3. ``inflate``: 20 gRPC calls a second of 1,024 texts of "a" after a 250-token literal prompt,
   with a 1 s deadline; ``deflate``: 16 closed-loop callers of 8 texts, each call marked
   ``kembed-retry-attempt: 1``. For these two the demand gauge is judged: ``kembed_demand_ratio``
   at the phase's end against the served load weighted the same way (the padded tokens computed,
   ``kembed_tokens_total``, sampled each second into an EWMA of the demand's time constant, over
   the capacity), in the gauge's unit (the two differ by the padding the engine's packed batches
   save: the ratio of the two while the bystander alone is served, all of it admitted): within 25%;
4. ``bodies_tokenize`` and ``bodies_embeddings``: 4 connections sending a 925 KB body of 1,024
   texts back to back; ``ingest`` (not an attack, for comparison) sends the same texts as a
   well-behaved client does: kembed's client, a call at a time, its pushback honoured;
5. ``idle_addresses`` (``capped`` alone): one idle connection from each of 16 addresses, reopened
   when closed.

Target: during each attack the bystander keeps >= 90% of its calls OK and >= 0.5 of its calls/s
before it. Writes ``bench/results/attacks.json`` with the machine (CPU, load average), keeping the
settings and attacks of earlier runs it does not repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc

from bench import RESULTS_DIR
from bench.tools import machine
from bench.tools.report import metric_sum
from bench.tools.server import HOST, Server, running
from kembed.client import EmbedClient, EmbedError
from kembed.config import Settings
from kembed.contract import GRPC_SERVICE, RETRY_ATTEMPT_KEY, Metric
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

SETTINGS = {
    "default": {"compile": "off"},
    "small": {"compile": "off", "memory_limit_bytes": "2147483648"},
    "capped": {"compile": "off", "memory_limit_bytes": "2147483648", "max_rest_connections": "16"},
}
CAPPED = ("idle_addresses",)  # the attacks run at the capped setting alone
ATTACKS = (
    "silent",
    "heads",
    "inflate",
    "deflate",
    "bodies_tokenize",
    "bodies_embeddings",
    "ingest",
    "idle_addresses",
)
JUDGED_GAUGE = ("inflate", "deflate")
NOT_BYSTANDER = ("deflate", "ingest")  # a saturating client, and a well-behaved one: no bystander target
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
BYSTANDER_ADDRESS = "127.0.0.2"
DEADLINE_S = 10.0
SENTENCE = "Admission control rejects early instead of queueing into timeouts and memory exhaustion."
WORDS = ["kubernetes", "scales", "embedding", "servers", "on", "their", "own", "metrics", "and", "refuses"]
TAU_S = Settings().demand_window_s


def big_body() -> bytes:
    """1,024 texts of about 900 characters: 925 KB."""
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(130))[:900] for i in range(1024)]
    return json.dumps({"input": texts}).encode()


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


# -- the bystander -------------------------------------------------------------------------------


async def _grpc_caller(stub: pb_grpc.EmbedderStub, stop_at: float, codes: Counter[str]) -> None:
    while time.monotonic() < stop_at:
        try:
            await stub.Embed(pb.EmbedRequest(texts=[SENTENCE]), timeout=DEADLINE_S)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as error:
            codes[error.code().name] += 1
            await asyncio.sleep(0.05)


async def _rest_caller(port: int, stop_at: float, codes: Counter[str]) -> None:
    body = json.dumps({"input": [SENTENCE]}).encode()
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(HOST, port, local_addr=(BYSTANDER_ADDRESS, 0)), DEADLINE_S
            )
            try:
                writer.write(post_head("/v1/embeddings", len(body)) + body)
                status = (await asyncio.wait_for(reader.readuntil(b"\r\n"), DEADLINE_S)).split(b" ")[1].decode()
            finally:
                writer.close()
            codes["OK" if status == "200" else status] += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as error:
            codes[type(error).__name__] += 1
            await asyncio.sleep(0.05)


def bystander(target: str, rest_port: int, duration: float, out: Any) -> None:
    async def run() -> dict[str, Any]:
        stop_at = time.monotonic() + duration
        grpc_codes, rest_codes = Counter[str](), Counter[str]()
        async with grpc.aio.insecure_channel(target, options=OWN_CONNECTION) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            await asyncio.gather(
                *(_grpc_caller(stub, stop_at, grpc_codes) for _ in range(4)),
                _rest_caller(rest_port, stop_at, rest_codes),
            )
        return {"grpc": _summary(grpc_codes, duration), "rest": _summary(rest_codes, duration)}

    out.put(asyncio.run(run()))


def _summary(codes: Counter[str], duration: float) -> dict[str, Any]:
    calls = sum(codes.values())
    return {
        "calls": calls,
        "ok_share": round(codes["OK"] / calls, 3) if calls else 0.0,
        "ok_per_s": round(codes["OK"] / duration, 2),
        "codes": dict(codes),
    }


# -- the attackers -------------------------------------------------------------------------------


def silent(target: str, calls: int, stop: Event) -> None:
    """gRPC Embed calls that send their head and never their message, reopened when cut."""

    async def run() -> None:
        channels = [grpc.aio.insecure_channel(target, options=OWN_CONNECTION) for _ in range(7)]
        embeds = [
            c.stream_unary(
                f"/{GRPC_SERVICE}/Embed",
                request_serializer=pb.EmbedRequest.SerializeToString,
                response_deserializer=pb.EmbedResponse.FromString,
            )
            for c in channels
        ]

        async def nothing() -> Any:
            await asyncio.sleep(3600)
            yield pb.EmbedRequest()

        async def hold(embed: Any) -> None:
            while not stop.is_set():
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await embed(nothing(), timeout=300)

        tasks = [asyncio.create_task(hold(embeds[i % len(embeds)])) for i in range(calls)]
        await asyncio.to_thread(stop.wait)
        for task in tasks:
            task.cancel()
        for channel in channels:
            await channel.close(None)

    asyncio.run(run())


def _hold_sockets(opened: Callable[[], socket.socket | None], count: int, stop: Event) -> None:
    """``count`` sockets from ``opened``, each opened again when the server closes it."""
    held: list[socket.socket] = []
    while not stop.is_set():
        while len(held) < count and (sock := opened()) is not None:
            held.append(sock)
        kept = []
        for sock in held:
            try:
                if sock.recv(65536, socket.MSG_DONTWAIT) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            kept.append(sock)
        held = kept
        stop.wait(0.2)
    for sock in held:
        sock.close()


def heads(port: int, length: int, count: int, stop: Event) -> None:
    def opened() -> socket.socket | None:
        try:
            sock = socket.create_connection((HOST, port), timeout=5)
            sock.sendall(post_head("/v1/embeddings", length))
            return sock
        except OSError:
            return None

    _hold_sockets(opened, count, stop)


def idle_addresses(port: int, stop: Event) -> None:
    addresses = iter(range(10**9))

    def opened() -> socket.socket | None:
        source = (f"127.0.0.{10 + next(addresses) % 16}", 0)
        try:
            return socket.create_connection((HOST, port), timeout=5, source_address=source)
        except OSError:
            return None

    _hold_sockets(opened, 16, stop)


def inflate(target: str, stop: Event) -> None:
    request = pb.EmbedRequest(texts=["a"] * 1024, prompt="a " * 250)

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)

            async def one() -> None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Embed(request, timeout=1.0)

            pending = set()
            while not stop.is_set():
                pending.add(asyncio.create_task(one()))
                pending = {task for task in pending if not task.done()}
                await asyncio.sleep(0.05)

    asyncio.run(run())


def deflate(target: str, stop: Event) -> None:
    request = pb.EmbedRequest(texts=[SENTENCE] * 8)

    async def run() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)

            async def caller() -> None:
                while not stop.is_set():
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await stub.Embed(request, timeout=30, metadata=((RETRY_ATTEMPT_KEY, "1"),))

            await asyncio.gather(*(caller() for _ in range(16)))

    asyncio.run(run())


def ingest(target: str, stop: Event) -> None:
    """Not an attack: the texts of ``bodies`` sent as a well-behaved client does (kembed's client:
    one call at a time, its pushback honoured, its retries marked), for comparison."""
    texts = json.loads(big_body())["input"]
    with EmbedClient(target) as client:
        while not stop.is_set():
            with contextlib.suppress(EmbedError):
                client.embed(texts)


def bodies(port: int, path: str, stop: Event) -> None:
    body = big_body()

    async def connection() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(HOST, port)
                try:
                    while not stop.is_set():
                        writer.write(post_head(path, len(body)) + body)
                        head = await reader.readuntil(b"\r\n\r\n")
                        length = int(re.search(rb"Content-Length: (\d+)", head, re.I)[1])  # type: ignore[index]
                        await reader.readexactly(length)
                        if b"Connection: close" in head:
                            break
                finally:
                    writer.close()
            except (OSError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.05)

    async def run() -> None:
        await asyncio.gather(*(connection() for _ in range(4)))

    asyncio.run(run())


# -- the phases ----------------------------------------------------------------------------------


def _budget(log: Path) -> tuple[int, int]:
    """The front end's memory budget in bytes and its gRPC call slots, off its first log line."""
    found = re.search(r"memory budget (\d+) MiB; gRPC takes (\d+) calls", log.read_text(errors="replace"))
    assert found, log
    return int(found[1]) * 2**20, int(found[2])


def _attacker(name: str, server: Server, log: Path, stop: Event) -> tuple[Callable[..., None], tuple[Any, ...]]:
    rest_port = int(server.rest_url.rsplit(":", 1)[1])
    budget, slots = _budget(log)
    largest = Settings().max_message_bytes
    attackers: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {
        "silent": (silent, (server.grpc_target, slots, stop)),
        "heads": (heads, (rest_port, largest, math.ceil(1.25 * budget / (2 * largest)), stop)),
        "inflate": (inflate, (server.grpc_target, stop)),
        "deflate": (deflate, (server.grpc_target, stop)),
        "bodies_tokenize": (bodies, (rest_port, "/tokenize", stop)),
        "bodies_embeddings": (bodies, (rest_port, "/v1/embeddings", stop)),
        "ingest": (ingest, (server.grpc_target, stop)),
        "idle_addresses": (idle_addresses, (rest_port, stop)),
    }
    return attackers[name]


class Gauges:
    """The demand gauge, and the served load weighted as it is (the padded tokens computed,
    ``kembed_tokens_total``, added each second to an EWMA of the demand's time constant, over the
    capacity), sampled each second for the server's life."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._stop = threading.Event()
        self.now = {"demand_ratio": 0.0, "served_ratio": 0.0}
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        served, previous, at = 0.0, metric_sum(self._server.metrics(), "kembed_tokens_total"), time.monotonic()
        while not self._stop.wait(1.0):
            samples, now = self._server.metrics(), time.monotonic()
            tokens = metric_sum(samples, "kembed_tokens_total")
            served = served * math.exp(-(now - at) / TAU_S) + (tokens - previous) / TAU_S
            previous, at, capacity = tokens, now, metric_sum(samples, Metric.CAPACITY)
            self.now = {
                "demand_ratio": round(metric_sum(samples, Metric.DEMAND_RATIO), 3),
                "served_ratio": round(served / capacity, 3) if capacity else 0.0,
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _phase(server: Server, log: Path, gauges: Gauges, attack: str | None, phase_s: float) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    attacker = None
    if attack is not None:
        target, args = _attacker(attack, server, log, stop)
        attacker = context.Process(target=target, args=args)
        attacker.start()
        time.sleep(3.0)  # the attack in place before the bystander counts
    rest_port = int(server.rest_url.rsplit(":", 1)[1])
    watcher = context.Process(target=bystander, args=(server.grpc_target, rest_port, phase_s, out))
    watcher.start()
    result = {"bystander": out.get(), **gauges.now}
    watcher.join()
    stop.set()
    if attacker is not None:
        attacker.join(30)
        if attacker.is_alive():
            attacker.kill()
    return result


def _judged(before: dict[str, Any], during: dict[str, Any], attack: str) -> dict[str, Any]:
    verdict: dict[str, Any] = {}
    for kind in () if attack in NOT_BYSTANDER else ("grpc", "rest"):
        was, now = before["bystander"][kind], during["bystander"][kind]
        kept = now["ok_per_s"] / was["ok_per_s"] if was["ok_per_s"] else 0.0
        verdict[kind] = {"ok_share": now["ok_share"], "kept_calls_per_s": round(kept, 2)}
        verdict[kind]["met"] = now["ok_share"] >= 0.9 and kept >= 0.5
    if attack in JUDGED_GAUGE:  # against the served load, in the gauge's unit as the bystander alone reads it
        unit = before["demand_ratio"] / before["served_ratio"] if before["served_ratio"] else math.nan
        served = during["served_ratio"] * unit
        off = abs(during["demand_ratio"] / served - 1) if served else math.inf
        verdict["gauge"] = {"off_by": round(off, 3), "met": off <= 0.25}
    return verdict


def run_setting(name: str, attacks: Sequence[str], phase_s: float) -> dict[str, Any]:
    log = RESULTS_DIR / f"attacks_{name}_server.log"
    results: dict[str, Any] = {}
    with running(SETTINGS[name], log) as server:
        gauges = Gauges(server)
        for attack in attacks:
            if (attack in CAPPED) != (name == "capped"):
                continue  # 1,024 addresses at the default cap; the others want the default cap
            before = _phase(server, log, gauges, None, phase_s)
            during = _phase(server, log, gauges, attack, phase_s)
            results[attack] = {"before": before, "during": during, "judged": _judged(before, during, attack)}
            print(f"{name} {attack}: {json.dumps(results[attack]['judged'])}", flush=True)
        gauges.close()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="small,capped,default", help="of: " + ", ".join(SETTINGS))
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="of: " + ", ".join(ATTACKS))
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of each phase")
    args = parser.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    earlier = machine.read_result("attacks") or {}
    settings: dict[str, Any] = earlier.get("settings", {})
    for name in filter(None, args.settings.split(",")):
        settings[name] = {**settings.get(name, {}), **run_setting(name, attacks, args.phase_s)}
    machine.write_result("attacks", {"phase_s": args.phase_s, "settings": settings})


if __name__ == "__main__":
    main()
