"""The robustness probes: an oversized body, a large head, an idle connection, a slowloris and a
graceful stop, against each stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from bench import RESULTS_DIR
from bench.edges.http_edges import api
from bench.edges.http_stacks.servers import PROBE_LIMITS, PROBE_WAIT_S, TEXT, request_body, started
from bench.tools.server import HOST


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(HOST, port)


async def _closed_after(reader: asyncio.StreamReader, limit: float) -> float | None:
    """Seconds until the server closes the connection (whatever it sends first), or None if it is still open."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(limit):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    return time.perf_counter() - t0


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: {HOST}\r\ncontent-type: {api.JSON}\r\n"
            f"content-length: {length}\r\n\r\n").encode()  # fmt: skip


async def _status(reader: asyncio.StreamReader) -> int | None:
    line = await reader.readline()
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None


async def _status_after(port: int, parts: Iterable[bytes]) -> int | None:
    """Send ``parts`` whole, as most clients do before they read, then the answer's status
    (None: the connection was dropped unanswered)."""
    reader, writer = await _connect(port)
    with contextlib.suppress(ConnectionError):
        for part in parts:
            writer.write(part)
            await writer.drain()
    try:
        return await asyncio.wait_for(_status(reader), PROBE_WAIT_S)
    except (TimeoutError, ConnectionError, ValueError):
        return None
    finally:
        writer.close()


async def probe_oversized(port: int, limit: int) -> int | None:
    """Status for a body twice the limit."""
    chunk = b" " * 65536
    return await _status_after(port, [_head(api.EMBEDDINGS_PATH, 2 * limit)] + [chunk] * (2 * limit // len(chunk)))


async def probe_large_head(port: int) -> int | None:
    """Status for a valid request with one header 1 MiB long (200: taken)."""
    body = request_body("base64")
    head = _head(api.EMBEDDINGS_PATH, len(body))[:-2] + b"x-padding: " + b"a" * (1 << 20) + b"\r\n\r\n"
    return await _status_after(port, [head + body])


async def probe_idle(port: int) -> float | None:
    """After one answered call on a keep-alive connection, seconds until the server closes it."""
    reader, writer = await _connect(port)
    body = request_body("base64")
    writer.write(_head(api.EMBEDDINGS_PATH, len(body)) + body)
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    closed = await _closed_after(reader, PROBE_WAIT_S)
    writer.close()
    return closed


async def probe_slowloris(port: int) -> float | None:
    """Headers trickled one byte every 0.2 s, never finished: seconds until the server closes, or None."""
    reader, writer = await _connect(port)
    trickle = _head(api.EMBEDDINGS_PATH, 10)[:-2] + b"x-padding: " + b"a" * 1000

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in trickle:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)

    sender = asyncio.create_task(send())
    closed = await _closed_after(reader, PROBE_WAIT_S)
    sender.cancel()
    writer.close()
    return closed


async def probe_graceful(port: int, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """A call that takes 1 s, SIGTERM while it is in flight: is it answered, and does the server exit 0?"""
    reader, writer = await _connect(port)
    body = json.dumps({"input": TEXT, "model": "m", "delay_s": 1.0}).encode()
    writer.write(_head(api.EMBEDDINGS_PATH, len(body)) + body)
    await writer.drain()
    await asyncio.sleep(0.3)  # the request is in the handler's sleep by now
    proc.send_signal(signal.SIGTERM)
    try:
        status = await asyncio.wait_for(_status(reader), PROBE_WAIT_S)
    except (TimeoutError, ConnectionError, ValueError):
        status = None
    writer.close()
    exit_code = await asyncio.to_thread(proc.wait, PROBE_WAIT_S)
    return {"in_flight_status": status, "exit_code": exit_code}


def probes(stack: str) -> dict[str, Any]:
    with started(stack, PROBE_LIMITS, RESULTS_DIR / "tmp" / f"http_probe_{stack}.log") as (server, proc):
        figures: dict[str, Any] = {
            "oversized_status": asyncio.run(probe_oversized(server.port, PROBE_LIMITS.max_body_bytes)),
            "large_head_status": asyncio.run(probe_large_head(server.port)),
            "idle_closed_after_s": asyncio.run(probe_idle(server.port)),
            "slowloris_closed_after_s": asyncio.run(probe_slowloris(server.port)),
        }
        figures["graceful"] = asyncio.run(probe_graceful(server.port, proc))
    return {"limits": asdict(PROBE_LIMITS), "wait_s": PROBE_WAIT_S, **figures}
