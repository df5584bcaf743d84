"""How requests should cross from a front end to the engine: ``python -m bench.edges.ipc``.

The same traffic over three transports, each between two processes on this machine: a "front end"
sends messages of R requests (one short text each: 12 token ids, a tag and a deadline) and an
"engine" answers each with R rows of 384 float32, with W messages in flight.

- ``frames``: kembed's own (``kembed.ipc``): one frame of contiguous arrays per message over a Unix
  socket, asyncio on both ends;
- ``zmq``: pyzmq PAIR sockets over ``ipc://``, the same arrays as multipart zero-copy frames,
  ``zmq.asyncio`` on both ends;
- ``pickle``: a ``multiprocessing`` pipe carrying a list of per-request dicts of numpy arrays:
  per-item pickling, what a straightforward multiprocessing design sends.

Per transport and R: requests/s and the CPU microseconds both processes spent per request (the
steadier figure on a shared machine). Writes ``bench/results/ipc.json``; the README's "Choices"
quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pickle
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.tools.machine import write_result
from kembed.ipc.protocol import LinkClosed, Result, Work, join_request_ids, receive, send

DIMENSIONS = 384
TOKENS = 12
TRANSPORTS = ("frames", "zmq", "pickle")


def _work(requests: int) -> Work:
    return Work(
        tags=np.arange(requests, dtype="<u8"),
        deadlines=np.full(requests, 1e9, dtype="<f8"),
        counts=np.ones(requests, dtype="<u4"),
        costs=np.full(requests, 16, dtype="<u8"),
        priorities=np.zeros(requests, dtype="u1"),
        lengths=np.full(requests, TOKENS, dtype="<i4"),
        ids=np.ones(requests * TOKENS, dtype="<i4"),
        cancels=np.empty(0, dtype="<u8"),
        latencies=np.empty(0, dtype="<f8"),
        sample_priorities=np.empty(0, dtype="u1"),
        sample_refused=np.empty(0, dtype="u1"),
        request_ids=join_request_ids([""] * requests),
    )


def _rows(requests: int) -> np.ndarray:
    return np.zeros((requests, DIMENSIONS), dtype="<f4")


# --- the "engine" ends, each in its own process, serving until it is killed ---


async def _frames_engine(path: str) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                work = await receive(reader)
            except LinkClosed:
                return
            assert isinstance(work, Work)
            requests = work.tags.size
            send(writer, Result(0.0, 0.0, work.tags, np.zeros(requests, "<u4"), _rows(requests)))

    await asyncio.start_unix_server(serve, path=path)
    await asyncio.Event().wait()


async def _zmq_engine(address: str) -> None:
    import zmq
    import zmq.asyncio

    socket = zmq.asyncio.Context().socket(zmq.PAIR)
    socket.bind(address)
    while True:
        parts = await socket.recv_multipart(copy=False)
        requests = len(parts[0].buffer) // 8
        await socket.send_multipart(
            [np.zeros(2), parts[0].buffer, np.zeros(requests, "<u4"), _rows(requests)], copy=False
        )


def _pickle_engine(conn: Connection) -> None:
    while True:
        conn.send([{"tag": request["tag"], "row": np.zeros(DIMENSIONS, "<f4")} for request in conn.recv()])


def _engine(transport: str, address: str, conn: Connection | None) -> None:
    if transport == "frames":
        asyncio.run(_frames_engine(address))
    elif transport == "zmq":
        asyncio.run(_zmq_engine(address))
    else:
        assert conn is not None
        _pickle_engine(conn)


# --- the "front end" ends, in this process: W messages in flight until the time is up ---


async def _frames_front(path: str, requests: int, window: int, seconds: float) -> int:
    reader, writer = await asyncio.open_unix_connection(path)
    work = _work(requests)
    for _ in range(window):
        send(writer, work)
    answered, deadline = 0, time.perf_counter() + seconds
    while answered < window or time.perf_counter() < deadline:
        result = await receive(reader)
        assert isinstance(result, Result) and result.rows.shape == (requests, DIMENSIONS)
        answered += 1
        if time.perf_counter() < deadline:
            send(writer, work)
        elif answered % window == 0:
            break
    writer.close()
    return answered


async def _zmq_front(address: str, requests: int, window: int, seconds: float) -> int:
    import zmq
    import zmq.asyncio

    socket = zmq.asyncio.Context().socket(zmq.PAIR)
    socket.connect(address)
    work = _work(requests).encode()
    for _ in range(window):
        await socket.send_multipart(work, copy=False)
    answered, in_flight, deadline = 0, window, time.perf_counter() + seconds
    while in_flight:
        parts = await socket.recv_multipart(copy=False)
        np.frombuffer(parts[3].buffer, "<f4").reshape(requests, DIMENSIONS)
        answered, in_flight = answered + 1, in_flight - 1
        if time.perf_counter() < deadline:
            await socket.send_multipart(work, copy=False)
            in_flight += 1
    socket.close(0)
    return answered


def _pickle_front(conn: Connection, requests: int, window: int, seconds: float) -> int:
    work = [{"tag": i, "deadline": 1e9, "ids": np.ones(TOKENS, "<i4")} for i in range(requests)]
    for _ in range(window):
        conn.send(work)
    answered, in_flight, deadline = 0, window, time.perf_counter() + seconds
    while in_flight:
        np.stack([answer["row"] for answer in conn.recv()])
        answered, in_flight = answered + 1, in_flight - 1
        if time.perf_counter() < deadline:
            conn.send(work)
            in_flight += 1
    return answered


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(transport: str, requests: int, window: int, seconds: float) -> dict[str, Any]:
    """One transport at one message size: requests/s and CPU us per request, both ends."""
    with tempfile.TemporaryDirectory() as tmp:
        address = f"{tmp}/engine.sock" if transport == "frames" else f"ipc://{tmp}/engine.zmq"
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe() if transport == "pickle" else (None, None)
        engine = context.Process(target=_engine, args=(transport, address, theirs), daemon=True)
        engine.start()
        try:
            socket_file = Path(address.removeprefix("ipc://"))
            for _ in range(600):  # the engine imports (this module, so torch too) and binds
                if transport == "pickle" or socket_file.exists():
                    break
                time.sleep(0.05)
            cpu_before = _cpu_seconds(os.getpid()) + _cpu_seconds(engine.pid or 0)
            started = time.perf_counter()
            messages = _run(transport, address, ours, requests, window, seconds)
            elapsed = time.perf_counter() - started
            cpu = _cpu_seconds(os.getpid()) + _cpu_seconds(engine.pid or 0) - cpu_before
        finally:
            engine.kill()
            engine.join()
    total = messages * requests
    return {
        "transport": transport,
        "requests_per_message": requests,
        "window": window,
        "requests_per_second": round(total / elapsed),
        "cpu_us_per_request": round(cpu / total * 1e6, 2),
    }


def _run(transport: str, address: str, conn: Connection | None, requests: int, window: int, seconds: float) -> int:
    if transport == "frames":
        return asyncio.run(_frames_front(address, requests, window, seconds))
    if transport == "zmq":
        return asyncio.run(_zmq_front(address, requests, window, seconds))
    assert conn is not None
    return _pickle_front(conn, requests, window, seconds)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,16", help="requests per message, comma-separated")
    parser.add_argument("--window", type=int, default=8, help="messages in flight")
    parser.add_argument("--seconds", type=float, default=3.0, help="per transport and size")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    args = parser.parse_args(argv)
    rows = [
        measure(transport, int(requests), args.window, args.seconds)
        for requests in args.requests.split(",")
        for transport in args.transports.split(",")
    ]
    for row in rows:
        print(
            f"{row['transport']:>7}  {row['requests_per_message']:>3} req/msg  "
            f"{row['requests_per_second']:>9,} req/s  {row['cpu_us_per_request']:>7.1f} CPU us/req"
        )
    write_result("ipc", {"method": __doc__.split("\n\n")[1], "pickle_protocol": pickle.DEFAULT_PROTOCOL, "rows": rows})


if __name__ == "__main__":
    main()
