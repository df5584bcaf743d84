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
import json
import math
import multiprocessing
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc

from bench import RESULTS_DIR
from bench.serving.attackers import (
    OWN_CONNECTION,
    SENTENCE,
    bodies,
    deflate,
    heads,
    idle_addresses,
    inflate,
    ingest,
    post_head,
    silent,
)
from bench.tools import machine
from bench.tools.report import metric_sum
from bench.tools.server import HOST, Server, running
from kembed.config.settings import Settings
from kembed.contract import Metric
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
BYSTANDER_ADDRESS = "127.0.0.2"
DEADLINE_S = 10.0
TAU_S = Settings().demand_window_s


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
