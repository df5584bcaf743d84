"""Pings beside a hostile client, in one run: ``python -m bench.serving.abuse``.

One zero-cost server (``bench.tools.zero_cost``, ``KEMBED_FRONTENDS=1``: every client meets the same front
end). A pinger process sends ``GET /v1/models`` on a keep-alive connection (opening another when the
server closed it) and gRPC ``Info`` on a channel, each every ``--interval-ms``, for ``--duration``
seconds of each phase, and records every ping's latency:

1. **idle**: nothing else runs;
2. **bad bodies**: an abuser process sends maximal bad REST bodies back to back, each on a new
   connection: ``{"input": [[0], [0], ...]}`` and ``{"input": ["a", "a", ...]}`` of
   ``KEMBED_MAX_MESSAGE_BYTES`` each, in turn (millions of items: refused at the item past the limit);
3. **slow bodies**: an abuser process holds as many slow bodies as it can open (up to
   ``--slow-connections``): a head announcing the largest body, then a byte a second on each, a new
   connection for each one the server closes.

Per phase the pings' p50/p95/p99, and what the abuser got (bodies sent and their codes; connections
held). Ratios: each phase's ping p99 over the idle p99, for ``/v1/models`` and for ``Info``. Target:
<= 3. The pinger and the abuser share the machine's cores with the server: on a 2-core machine the
figures measure the server's event loop and the machine's scheduler together. Writes
``bench/results/abuse.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import resource
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event
from typing import Any

import grpc

from bench import RESULTS_DIR, headline
from bench.tools import machine
from bench.tools.report import latency_summary, ratio_table
from bench.tools.server import Server, running
from kembed.config.settings import Settings
from kembed.v1 import embedder_pb2, embedder_pb2_grpc

ZERO_COST = "bench.tools.zero_cost"
PHASES = headline.ABUSE_PHASES


@dataclass(frozen=True)
class Options:
    duration: float  # seconds of pings per phase
    interval_ms: float  # between one ping's answer and the next ping, per kind
    slow_connections: int  # the most slow bodies the abuser tries to hold
    settle: float  # seconds an abuser runs before the pings of its phase are counted


def bad_bodies(max_bytes: int) -> list[bytes]:
    """Two maximal bodies of millions of items each, just under the body limit."""
    bodies = []
    for item in (b"[0]", b'"a"'):
        count = (max_bytes - 16) // (len(item) + 1)
        bodies.append(b'{"input": [' + b",".join([item] * count) + b"]}")
    return bodies


def _head(length: int, port: int) -> bytes:
    return (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def send_bad_bodies(port: int, max_bytes: int, stop: Event, out: Any) -> None:
    """The abuser of the bad-bodies phase: maximal bad bodies back to back, each answered or cut."""
    bodies, codes, sent = bad_bodies(max_bytes), Counter[str](), 0
    while not stop.is_set():
        body = bodies[sent % len(bodies)]
        sent += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                with contextlib.suppress(OSError):  # the server answers and closes before it has read it all
                    sock.sendall(_head(len(body), port) + body)
                reply = sock.recv(64)
                codes[reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"] += 1
        except OSError as error:
            codes[type(error).__name__] += 1
    out.put({"bodies": sent, "codes": dict(codes)})


def hold_slow_bodies(port: int, max_bytes: int, limit: int, stop: Event, out: Any) -> None:
    """The abuser of the slow-bodies phase: as many slow bodies as it can open, a byte a second each."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    head, opened, most = _head(max_bytes, port), 0, 0
    held: list[socket.socket] = []
    while not stop.is_set():
        while len(held) < limit:  # top up: the server closes the oldest, and each at its deadline
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1)
                sock.sendall(head + b'{"input": ["')
                sock.setblocking(False)
            except OSError:
                break
            held.append(sock)
            opened += 1
        most = max(most, len(held))
        kept = []
        for sock in held:
            try:
                sock.send(b"a")
                kept.append(sock)
            except OSError:
                sock.close()
        held = kept
        stop.wait(1.0)
    for sock in held:
        sock.close()
    out.put({"opened": opened, "most_held": most})


def _content_length(head: bytes) -> int:
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))


async def _ping_rest(port: int, interval_s: float, stop_at: float, latencies: list[float], codes: Counter[str]) -> None:
    request = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        try:
            if writer is None or reader is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            codes[head.split(b" ", 2)[1].decode()] += 1
            latencies.append(time.perf_counter() - start)  # a ping that had to reconnect counts its connect
        except (OSError, asyncio.IncompleteReadError, StopIteration):
            codes["reconnect"] += 1
            if writer is not None:
                writer.close()
            reader = writer = None
            continue
        await asyncio.sleep(interval_s)
    if writer is not None:
        writer.close()


async def _ping_grpc(
    target: str, interval_s: float, stop_at: float, latencies: list[float], codes: Counter[str]
) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            try:
                await stub.Info(embedder_pb2.InfoRequest(), timeout=30)
                codes["OK"] += 1
                latencies.append(time.perf_counter() - start)
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
            await asyncio.sleep(interval_s)


def ping(rest_port: int, grpc_target: str, duration: float, interval_s: float, out: Any) -> None:
    """The pinger: both kinds of ping side by side for ``duration`` seconds."""

    async def both() -> dict[str, Any]:
        stop_at = time.monotonic() + duration
        rest: list[float] = []
        info: list[float] = []
        rest_codes, info_codes = Counter[str](), Counter[str]()
        await asyncio.gather(
            _ping_rest(rest_port, interval_s, stop_at, rest, rest_codes),
            _ping_grpc(grpc_target, interval_s, stop_at, info, info_codes),
        )
        return {
            "models": {"pings": len(rest), "codes": dict(rest_codes), "latency_ms": latency_summary(rest)},
            "info": {"pings": len(info), "codes": dict(info_codes), "latency_ms": latency_summary(info)},
        }

    out.put(asyncio.run(both()))


def _phase(server: Server, name: str, opts: Options, max_bytes: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    rest_port = int(server.rest_url.rsplit(":", 1)[1])
    abuser = None
    if name == "bad_bodies":
        abuser = context.Process(target=send_bad_bodies, args=(rest_port, max_bytes, stop, out))
    elif name == "slow_bodies":
        abuser = context.Process(target=hold_slow_bodies, args=(rest_port, max_bytes, opts.slow_connections, stop, out))
    if abuser is not None:
        abuser.start()
        time.sleep(opts.settle)
    pinger = context.Process(
        target=ping, args=(rest_port, server.grpc_target, opts.duration, opts.interval_ms / 1000, out)
    )
    pinger.start()
    pings = out.get()
    pinger.join()
    stop.set()
    result = {"pings": pings}
    if abuser is not None:
        result["abuser"] = out.get()
        abuser.join()
    p99 = {kind: pings[kind]["latency_ms"]["p99"] for kind in ("models", "info")}
    print(f"{name}: ping p99 ms {p99}")
    return result


def run(opts: Options) -> dict[str, Any]:
    settings = {"frontends": "1"}
    max_bytes = Settings().max_message_bytes
    with running(settings, RESULTS_DIR / "abuse_server.log", module=ZERO_COST) as server:
        phases = {name: _phase(server, name, opts, max_bytes) for name in PHASES}
    return {"settings": {**asdict(opts), "frontends": 1, "max_message_bytes": max_bytes}, "phases": phases}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of pings per phase")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between pings, per kind")
    parser.add_argument("--slow-connections", type=int, default=2000, help="the most slow bodies to hold")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of abuse before the pings count")
    args = parser.parse_args(argv)
    result = run(Options(args.duration, args.interval_ms, args.slow_connections, args.settle))
    rows = headline.abuse_ratios(result)
    result["ratios"] = [{"name": r.name, "value": r.value.to_dict(), "target": r.target, "met": r.met()} for r in rows]
    machine.write_result("abuse", result)
    print(ratio_table(rows))
    print(headline.abuse_table(result))


if __name__ == "__main__":
    main()
