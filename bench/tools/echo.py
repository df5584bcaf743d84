"""A bare gRPC echo of ``kembed.v1.Embedder/Embed``: a YARDSTICK for the host path, not a server.

It does what any Python gRPC server must do for a call and nothing else: it parses the request
and answers OK with an ``EmbedResponse`` of the size kembed would send (one row of 384 float32
zeros per text, precomputed per count), so the benchmarks can put kembed's host path beside
the least a ``grpc.aio`` process can do. ``--processes N`` share one port with SO_REUSEPORT, as
kembed's front ends do. It computes nothing, validates nothing, and must never serve clients.

    python -m bench.tools.echo --processes 2 --port 50061
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from kembed.contract import GRPC_SERVICE
from kembed.plumbing import listen
from kembed.v1 import embedder_pb2

HOST = "127.0.0.1"
DIMENSIONS = 384  # all-MiniLM-L6-v2, kembed's bundled model
# Explicit, though grpc turns SO_REUSEPORT on by default on Linux (tests/bench checks that).
SERVER_OPTIONS = (("grpc.so_reuseport", 1),)
START_TIMEOUT_S = 60.0


@functools.lru_cache(maxsize=1024)
def response_bytes(count: int) -> bytes:
    """What kembed answers for ``count`` texts: embeddings, shape, token counts and timings."""
    return embedder_pb2.EmbedResponse(
        embeddings=bytes(count * DIMENSIONS * 4),
        count=count,
        dimensions=DIMENSIONS,
        token_counts=[16] * count,
        timings=embedder_pb2.Timings(queue_ms=1.0, tokenize_ms=1.0, inference_ms=1.0, total_ms=3.0),
    ).SerializeToString()


async def _embed(request: embedder_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> bytes:
    return response_bytes(len(request.texts))


def handler() -> grpc.GenericRpcHandler:
    """Embed only: the request is parsed (as kembed must), the reply is precomputed bytes."""
    embed = grpc.unary_unary_rpc_method_handler(
        _embed, request_deserializer=embedder_pb2.EmbedRequest.FromString, response_serializer=None
    )
    return grpc.method_handlers_generic_handler(GRPC_SERVICE, {"Embed": embed})


async def _serve(port: int, parent: Connection) -> None:
    """One echo process; it ends when its parent does (even killed), so none is left behind."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler(),))
    if server.add_insecure_port(f"{HOST}:{port}") != port:
        raise RuntimeError(f"could not bind {HOST}:{port}")
    await server.start()
    parent.send(os.getpid())
    gone = asyncio.Event()
    asyncio.get_running_loop().add_reader(parent.fileno(), gone.set)  # the parent never writes: EOF
    await gone.wait()
    await server.stop(None)


def _process(port: int, parent: Connection) -> None:
    asyncio.run(_serve(port, parent))


def serve(processes: int, port: int, ready_file: Path | None) -> int:
    """Run ``processes`` echo processes on ``port`` (0: any free port) until SIGTERM or SIGINT (exit
    0), or until one of them dies (exit 1). Writes the port to ``ready_file`` once all of them serve."""
    # Bound, not listened on, as kembed's supervisor holds its port: a port of 0 names one for all.
    with listen.bind(HOST, port, "echo", "", reuse_port=True) as held:
        return _serve_all(processes, int(held.getsockname()[1]), ready_file)


def _serve_all(processes: int, port: int, ready_file: Path | None) -> int:
    context = multiprocessing.get_context("spawn")
    # A socket pair per child: it says when the child serves, and its EOF tells the child we ended.
    pipes = [context.Pipe() for _ in range(processes)]
    children = [context.Process(target=_process, args=(port, theirs), daemon=True) for _, theirs in pipes]
    try:
        for child in children:
            child.start()
        # Only now: the children would inherit the mask, and terminate() must reach them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # taken by sigtimedwait
        for ours, _ in pipes:
            if not ours.poll(START_TIMEOUT_S):
                raise RuntimeError(f"an echo process did not start in {START_TIMEOUT_S:.0f} s")
            ours.recv()
        print(f"echo: {processes} process(es) on {HOST}:{port} (a yardstick, not a server)", flush=True)
        if ready_file:
            written = ready_file.with_suffix(".tmp")
            written.write_text(str(port))
            written.replace(ready_file)  # whole, or not there
        while all(child.is_alive() for child in children):
            if signal.sigtimedwait({signal.SIGTERM, signal.SIGINT}, 0.5) is not None:
                return 0
        return 1
    finally:
        for child in children:
            with contextlib.suppress(ValueError):  # never started
                child.terminate()
            child.join(5)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--port", type=int, required=True, help="loopback port shared by every process (0: any)")
    parser.add_argument("--ready-file", type=Path, help="the port, written once every process serves")
    args = parser.parse_args(argv)
    sys.exit(serve(args.processes, args.port, args.ready_file))


if __name__ == "__main__":
    main()
