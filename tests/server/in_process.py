"""A gRPC Embedder served in the test's own process over loopback, answering as the test's servicer
says: the client's tests against a server that refuses, or checks keys, on cue. No process is
started (tests/lanes.py): the tests that use it stay in ``make unit``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc

from kembed.v1 import embedder_pb2_grpc as pb_grpc


@contextlib.contextmanager
def served(servicer: pb_grpc.EmbedderServicer) -> Iterator[str]:
    """``servicer`` served on a loopback port the kernel gives; yields its target, stops it after."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_EmbedderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
