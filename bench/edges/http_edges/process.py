"""One candidate's server process: a ``grpc.aio`` echo server and the stack on one loop, until
SIGTERM (``python -m bench.edges.http_edges --stack S --port P --ready-file F``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import grpc

from bench.edges import http_edges  # the package's docstring is the command's help
from bench.edges.http_edges.api import BACKLOG, HOST, Limits, Stop
from bench.edges.http_edges.candidates import STACKS
from bench.tools import echo

GRPC = "grpc"  # the bare gRPC echo on the measured port, no HTTP: the yardstick


def reuseport_socket(port: int) -> socket.socket:
    """A listening socket that other processes can bind too (SO_REUSEPORT), as front ends will.

    Its protocol must say TCP: asyncio sets TCP_NODELAY only on accepted sockets whose ``proto``
    is IPPROTO_TCP, and a stack that writes head and body apart (uvicorn) then waits out Nagle
    and the client's delayed ACK, about 40 ms a call."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


async def _grpc_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=echo.SERVER_OPTIONS)
    server.add_generic_rpc_handlers((echo.handler(),))
    if server.add_insecure_port(f"{HOST}:{port}") == 0:
        raise RuntimeError(f"could not bind {HOST}:{port}")
    await server.start()
    return server


async def serve(stack: str, port: int, limits: Limits, ready_file: Path) -> None:
    """Until SIGTERM: the gRPC server and the stack on one loop. ``ready_file`` gets what starting took."""
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    started = time.perf_counter()
    grpc_server = await _grpc_server(port if stack == GRPC else 0)  # idle beside an HTTP stack
    grpc_s = time.perf_counter() - started
    stop: Stop | None = None
    if stack != GRPC:
        sock = reuseport_socket(port)
        stop = await STACKS[stack](sock, limits)
    report = {"pid": os.getpid(), "grpc_start_s": grpc_s, "stack_start_s": time.perf_counter() - started - grpc_s,
              "limits": asdict(limits)}  # fmt: skip
    partial = ready_file.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    partial.rename(ready_file)  # whole, or not there
    await stopping.wait()
    if stop is not None:
        await stop()
    await grpc_server.stop(limits.drain_s)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=http_edges.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stack", required=True, choices=[GRPC, *STACKS])
    parser.add_argument("--port", type=int, required=True, help="loopback port of the measured server")
    parser.add_argument("--ready-file", type=Path, required=True, help="written (JSON) once serving")
    defaults = Limits()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    limits = Limits(**{f: getattr(args, f) for f in asdict(defaults)})
    asyncio.run(serve(args.stack, args.port, limits, args.ready_file))
