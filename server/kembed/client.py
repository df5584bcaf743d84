"""A small client: texts in, a numpy array out, overload handled politely.

RESOURCE_EXHAUSTED is retried after the server's ``grpc-retry-pushback-ms`` (with jitter), and
UNAVAILABLE (warming up, draining, a replica going away) with exponential backoff, both bounded.

    from kembed.client import EmbedClient
    with EmbedClient("127.0.0.1:50051") as client:
        vectors = client.embed(["hello world"])   # float32 [1, 384], L2-normalised

TLS: ``EmbedClient(target, ca_file="ca.crt")``, plus ``cert_file`` and ``key_file`` for mTLS.

``python -m kembed.client --target HOST:PORT [--ca-file F [--cert-file F --key-file F]] TEXT...``
prints shapes and timings.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from kembed.contract import RETRY_PUSHBACK_KEY
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc

T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class EmbedClient:
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 6,
        backoff_s: float = 0.1,
        max_message_bytes: int = 16 * 1024 * 1024,
        round_robin: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if round_robin:  # spread calls over every address a headless Service's name resolves to
            options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})))
        if ca_file is None and cert_file is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, channel_credentials(ca_file, cert_file, key_file), options)
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self._timeout = timeout_s
        self._max_attempts = max_attempts
        self._backoff = backoff_s
        self._sleep = sleep
        self.retries = 0  # how many attempts were retried, for callers that want to know

    def embed(
        self, texts: Sequence[str], *, normalize: bool = True, dimensions: int = 0, truncate: bool = False
    ) -> np.ndarray:
        request = pb.EmbedRequest(texts=texts, normalize=normalize, dimensions=dimensions, truncate=truncate)
        return decode(self.embed_request(request))

    def embed_tokens(
        self, sequences: Sequence[Sequence[int]], *, normalize: bool = True, dimensions: int = 0
    ) -> np.ndarray:
        """Pre-tokenized input (ids including the model's special tokens)."""
        ids = np.concatenate([np.asarray(seq, dtype="<i4") for seq in sequences])
        tokens = pb.TokenIds(ids=ids.tobytes(), lengths=[len(seq) for seq in sequences])
        request = pb.EmbedRequest(tokens=tokens, normalize=normalize, dimensions=dimensions)
        return decode(self.embed_request(request))

    def embed_request(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        return self._with_retries(lambda: self._stub.Embed(request, timeout=self._timeout))

    def info(self) -> pb.InfoResponse:
        return self._with_retries(lambda: self._stub.Info(pb.InfoRequest(), timeout=self._timeout))

    def _with_retries(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self._timeout
        for attempt in range(1, self._max_attempts + 1):
            try:
                return call()
            except grpc.RpcError as error:
                wait = self._retry_after(error, attempt)
                if wait is None or attempt == self._max_attempts or time.monotonic() + wait > deadline:
                    raise
                self.retries += 1
                self._sleep(wait)
        raise AssertionError("unreachable")

    def _retry_after(self, error: grpc.RpcError, attempt: int) -> float | None:
        """Seconds to wait before retrying, or None when the error is final."""
        code = error.code() if isinstance(error, grpc.Call) else None
        if code not in RETRYABLE:
            return None
        jitter = random.uniform(0.8, 1.2)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(error, grpc.Call):
            for key, value in error.trailing_metadata() or ():
                if key == RETRY_PUSHBACK_KEY:
                    return int(value) / 1000 * jitter
        return self._backoff * 2 ** (attempt - 1) * jitter

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EmbedClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def channel_credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS trusting ``ca_file`` (None: the system's roots), presenting ``cert_file``/``key_file`` for mTLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file), private_key=_read(key_file), certificate_chain=_read(cert_file)
    )


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def decode(response: pb.EmbedResponse) -> np.ndarray:
    """The response's float32 little-endian buffer as a [count, dimensions] array."""
    return np.frombuffer(response.embeddings, dtype="<f4").reshape(response.count, response.dimensions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kembed.client", description="embed texts with a kembed server")
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--dimensions", type=int, default=0)
    parser.add_argument("--ca-file", help="PEM CA bundle the server's certificate must chain to: turns TLS on")
    parser.add_argument("--cert-file", help="PEM client certificate, for a server that requires mTLS")
    parser.add_argument("--key-file", help="PEM private key of --cert-file")
    parser.add_argument("texts", nargs="+")
    args = parser.parse_args(argv)
    tls = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}
    with EmbedClient(args.target, **tls) as client:
        info = client.info()
        response = client.embed_request(pb.EmbedRequest(texts=args.texts, dimensions=args.dimensions))
    vectors = decode(response)
    print(f"model {info.model_id}: {vectors.shape[0]} x {vectors.shape[1]} in {response.timings.total_ms:.1f} ms")
    for text, vector in zip(args.texts, vectors, strict=True):
        print(f"{text[:40]!r:44} [{', '.join(f'{v:+.4f}' for v in vector[:6])}, ...]")


if __name__ == "__main__":
    main()
