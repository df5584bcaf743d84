"""Closed-loop load on any OpenAI-compatible ``POST /v1/embeddings``: ``python -m bench.tools.http_loadgen``.

``--connections`` HTTP/1.1 keep-alive connections per client process, one call in flight on each,
each sending its next call when the last is answered, for ``--duration`` s. A raw asyncio client
(requests built up front, replies read by their framing and never parsed), so it takes little of
the CPU it shares with the server; ``--processes`` runs it in several client processes started
together (``bench.tools.loadgen.in_processes``). It reads Content-Length and chunked replies, and
reconnects after ``Connection: close``, a reset or a timed-out call (each counted by what
happened). Prints, and with ``--name`` writes to ``bench/results/NAME.json``: the status codes,
calls/s of 200s after ``--warmup`` (median and range over time windows) and latency percentiles.

Texts: the workload's shortest (<= 16 tokens, as ``bench.serving.hostpath``'s "one short text"), in
turn, ``--texts-per-call`` a call; or one fixed ``--text``.

    python -m bench.tools.http_loadgen --url http://127.0.0.1:7997/v1/embeddings --model minilm
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
import urllib.parse
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.tools import loadgen, machine
from bench.tools.loadgen import CallRecord
from bench.tools.report import Spread, latency_summary, window_rates

EMBEDDINGS_PATH = "/v1/embeddings"  # the OpenAI API's, on every server measured
MAX_CALLS = 1_000_000  # runs end on time; this only bounds a runaway
SHORT_TOKENS = 16
TIMEOUT = "timeout"  # the code of a call not answered within its deadline
ERROR = "error"  # the code of a call whose connection failed (refused, reset, closed mid-reply)
MAX_HEAD_BYTES = 64 * 1024


def embeddings_bodies(texts: Sequence[str], per_call: int, model: str, encoding_format: str) -> list[bytes]:
    """JSON bodies of ``per_call`` consecutive texts each (a string when 1), the texts reused in turn."""
    cycle = itertools.cycle(texts)
    bodies = []
    for _ in range(max(1, len(texts) // per_call)):
        chunk = list(itertools.islice(cycle, per_call))
        doc = {"input": chunk[0] if per_call == 1 else chunk, "model": model, "encoding_format": encoding_format}
        bodies.append(json.dumps(doc).encode())
    return bodies


def post_request(url: str, body: bytes) -> bytes:
    """The whole HTTP/1.1 request, keep-alive, as it goes on the wire."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    head = (f"POST {path or '/'} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
            f"accept: application/json\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


def _endpoint(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"url: only http://host[:port]/path is supported, not {url!r}")
    return parts.hostname, parts.port or 80


class ReplyError(Exception):
    """The server broke HTTP/1.1 framing: the connection cannot be reused."""


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Consume one whole reply (head, then the body by its framing): its status, and whether the
    connection stays open after it."""
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > MAX_HEAD_BYTES:
        raise ReplyError("reply head too large")
    status_line, *lines = head[:-4].split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    if not version.startswith(b"HTTP/1.") or not rest[:3].isdigit():
        raise ReplyError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    status = int(rest[:3])
    if status == 100:  # 100 Continue: the real reply follows
        return await read_reply(reader)
    if headers.get(b"transfer-encoding", b"").endswith(b"chunked"):
        await _read_chunked(reader)
    elif b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    elif status >= 200 and status not in (204, 304):
        await reader.read()  # the body runs to the end of the connection
        return status, False
    keep_alive = headers.get(b"connection") != b"close" and version == b"HTTP/1.1"
    return status, keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> None:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return
        await reader.readexactly(size + 2)  # the chunk and its CRLF


class Connection:
    """One keep-alive connection, opened again whenever the last call left it unusable."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.opened = 0

    async def open(self) -> None:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
            self.opened += 1

    async def call(self, request: bytes, deadline: float) -> str:
        """Send ``request``, read its reply whole within ``deadline`` s: the status code, or TIMEOUT or ERROR."""
        try:
            async with asyncio.timeout(deadline):
                await self.open()
                assert self._streams is not None
                reader, writer = self._streams
                writer.write(request)
                status, keep_alive = await read_reply(reader)
        except TimeoutError:
            self.close()
            return TIMEOUT
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ReplyError, ValueError):
            self.close()
            return ERROR
        if not keep_alive:
            self.close()
        return str(status)

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def closed_loop(
    url: str, requests: Sequence[bytes], connections: int, duration: float, count: int, deadline: float
) -> list[CallRecord]:
    """``connections`` clients, one connection and one call in flight each, until ``duration`` s
    or ``count`` calls in all; connected before the clock starts (and before the other client
    processes start, under ``in_processes``). Codes are HTTP statuses, TIMEOUT or ERROR."""
    host, port = _endpoint(url)
    opened = [Connection(host, port) for _ in range(connections)]
    await asyncio.gather(*(c.open() for c in opened))
    await loadgen.all_processes_ready()
    items = itertools.count()
    outcomes: list[CallRecord] = []
    t0 = time.perf_counter()

    async def client(connection: Connection) -> None:
        while (item := next(items)) < count and (sent := time.perf_counter() - t0) < duration:
            code = await connection.call(requests[item % len(requests)], deadline)
            outcomes.append(CallRecord(item, sent, sent, time.perf_counter() - t0, code))
            if code == ERROR:
                await asyncio.sleep(0.05)  # a refused connection is not retried in a tight loop

    try:
        await loadgen.bounded([asyncio.create_task(client(c)) for c in opened], duration + deadline + 1)
    finally:
        for connection in opened:
            connection.close()
    return sorted(outcomes, key=lambda o: o.sent)


def summarize(outcomes: Sequence[CallRecord], warmup: float, duration: float, windows: int = 4) -> dict[str, Any]:
    """Status codes of every call; calls/s of the 200s answered in [warmup, duration), median and
    range over ``windows``; their latency."""
    ok = [o for o in outcomes if o.code == "200"]
    rates = window_rates([o.done for o in ok], [1.0] * len(ok), warmup, duration, windows)
    return {
        "calls": len(outcomes),
        "codes": dict(Counter(o.code for o in outcomes)),
        "calls_per_s": Spread.of(rates).to_dict(),
        "latency_ms": latency_summary([o.latency for o in ok if o.done >= warmup]),
    }


def short_texts() -> list[str]:
    """The workload's texts of at most ``SHORT_TOKENS`` tokens."""
    from bench.tools import workload

    wl = workload.load()
    return [t for t, n in zip(wl.texts, wl.tokens, strict=True) if n <= SHORT_TOKENS]


def in_processes(url: str, bodies: Sequence[bytes], processes: int, connections: int, duration: float,
                 deadline: float) -> tuple[list[CallRecord], float]:  # fmt: skip
    """The closed loop from ``processes`` client processes started together: every call's outcome,
    and the CPU seconds the clients used."""
    requests = [post_request(url, body) for body in bodies]
    kwargs = [{"url": url, "requests": requests, "connections": connections, "duration": duration, "count": n,
               "deadline": deadline} for n in loadgen.split(MAX_CALLS, processes)]  # fmt: skip
    parts, client_cpu = loadgen.in_processes(closed_loop, kwargs)
    return [o for part in parts for o in part], client_cpu


def run(url: str, bodies: Sequence[bytes], processes: int, connections: int, duration: float, warmup: float,
        deadline: float) -> dict[str, Any]:  # fmt: skip
    """The closed loop from ``processes`` client processes: its summary, with the clients' CPU."""
    outcomes, client_cpu = in_processes(url, bodies, processes, connections, duration, deadline)
    return {**summarize(outcomes, warmup, duration), "client_cpu_s": client_cpu}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="http://host:port/v1/embeddings")
    parser.add_argument("--model", default="minilm", help="the request's model field")
    parser.add_argument("--encoding-format", default="float", choices=["float", "base64"])
    parser.add_argument("--text", help="one fixed text for every call, instead of the workload's short texts")
    parser.add_argument("--texts-per-call", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1, help="client processes")
    parser.add_argument("--connections", type=int, default=16, help="per client process, one call in flight each")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=5.0, help="first seconds left out of the rates")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a call may take")
    parser.add_argument("--name", help="also write bench/results/NAME.json")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.duration:
        parser.error("--warmup: must be at least 0 and below --duration")
    texts = [args.text] if args.text else short_texts()
    bodies = embeddings_bodies(texts, args.texts_per_call, args.model, args.encoding_format)
    figures = run(args.url, bodies, args.processes, args.connections, args.duration, args.warmup, args.timeout)
    result = {"settings": vars(args), **figures}
    print(json.dumps({k: result[k] for k in ("codes", "calls_per_s", "latency_ms")}, indent=2))
    if args.name:
        machine.write_result(args.name, result)
    return result


if __name__ == "__main__":
    main()
