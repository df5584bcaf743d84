"""A small client: texts in, a numpy array out, overload handled politely.

RESOURCE_EXHAUSTED is retried after the server's ``grpc-retry-pushback-ms`` (with jitter), and
UNAVAILABLE (warming up, draining, a replica going away) with exponential backoff, both bounded.

    from kembed.client import EmbedClient
    with EmbedClient("127.0.0.1:50051") as client:
        vectors = client.embed(["hello world"])   # float32 [1, 384], L2-normalised

TLS: ``EmbedClient(target, ca_file="ca.crt")``, plus ``cert_file`` and ``key_file`` for mTLS.

``python -m kembed.client --target HOST:PORT [--ca-file F [--cert-file F --key-file F]] TEXT...``
prints shapes and timings.

``python -m kembed.client embed --target HOST:PORT --input FILE|- --output OUT.npy|.jsonl|.parquet``
embeds a corpus (the work is in :mod:`kembed.bulk`): one text per line, or JSONL with
``--jsonl-field NAME``; rows in input order; ``--batch-texts`` (32) texts a request over one
EmbedStream, ``--in-flight`` (8) requests' worth of texts outstanding; ``truncate`` on unless
``--no-truncate`` (a corpus has documents longer than the model's limit); ``--priority batch``
unless told ``interactive`` (an ingest makes way for queries); refusals retried after
their pushback; a progress bar with tqdm (``pip install 'kembed[client]'``). Run the same command
again to go on after an interruption: the output holds its progress. ``embed`` as the first
argument picks this form; ``python -m kembed.client -- embed`` embeds the word.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
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
Number = TypeVar("Number", int, float)

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class EmbedClient:
    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 30.0,
        max_attempts: int = 6,
        backoff_s: float = 0.1,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        round_robin: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        options = channel_options(max_message_bytes, round_robin)
        credentials = tls_credentials(ca_file, cert_file, key_file)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options)
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


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES, round_robin: bool = False) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if round_robin:  # spread calls over every address a headless Service's name resolves to
        options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})))
    return options


def tls_credentials(ca_file: str | None, cert_file: str | None, key_file: str | None) -> grpc.ChannelCredentials | None:
    """None (plaintext) unless a CA or a client certificate is given."""
    if ca_file is None and cert_file is None:
        return None
    return channel_credentials(ca_file, cert_file, key_file)


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["embed"]:
        return embed_main(args[1:])
    return embed_texts_main(args)


def embed_texts_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed.client", description="embed texts with a kembed server")
    _connection_arguments(parser)
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
    return 0


def embed_main(argv: list[str]) -> int:
    """``python -m kembed.client embed``: a corpus to a file (kembed.bulk does the work)."""
    from kembed.bulk import BulkError
    from kembed.bulk.job import Interrupted, Job, run
    from kembed.bulk.outputs import FORMATS
    from kembed.priority import Priority

    parser = argparse.ArgumentParser(
        prog="python -m kembed.client embed",
        description="embed a corpus (a file or stdin, one text per line or JSONL) into .npy, JSONL or Parquet, "
        "in input order; run the same command again to go on after an interruption",
    )
    _connection_arguments(parser)
    parser.add_argument("--input", default="-", help="a text file, one text per line, or JSONL; - (default): stdin")
    parser.add_argument(
        "--jsonl-field", help="read the input as JSONL and embed this field of each line (default: text for *.jsonl)"
    )
    parser.add_argument("--output", required=True, type=Path, help="FILE.npy, FILE.jsonl or FILE.parquet (pyarrow)")
    parser.add_argument("--format", choices=FORMATS, help="the output's format, if not its extension")
    parser.add_argument("--batch-texts", type=_at_least(int, 1), default=32, help="texts per request (default 32)")
    parser.add_argument("--in-flight", type=_at_least(int, 1), default=8, help="requests in flight (default 8)")
    parser.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cut texts longer than the model's limit (default); --no-truncate: such a text fails the job",
    )
    parser.add_argument(
        "--priority",
        choices=[priority.label for priority in Priority],
        default=Priority.BATCH.label,
        help="the requests' class (default batch: an ingest, which queries go ahead of)",
    )
    parser.add_argument(
        "--give-up-after",
        type=_at_least(float, 0.0),
        default=300.0,
        metavar="SECONDS",
        help="stop when no row was written for this long (default 300); the rows written are kept",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar on stderr (tqdm)"
    )
    args = parser.parse_args(argv)
    job = Job(
        target=args.target,
        input=args.input,
        output=args.output,
        output_format=args.format,
        jsonl_field=args.jsonl_field,
        batch_texts=args.batch_texts,
        in_flight=args.in_flight,
        dimensions=args.dimensions,
        truncate=args.truncate,
        priority=Priority[args.priority.upper()],
        give_up_after_s=args.give_up_after,
        progress=args.progress,
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
    )
    try:
        summary = run(job)
    except Interrupted as interrupted:
        print(f"kembed embed: {interrupted}", file=sys.stderr)
        return 130
    except BulkError as error:
        print(f"kembed embed: {error}", file=sys.stderr)
        return 1
    counts = summary.counts
    print(
        f"{args.output}: {summary.rows} x {summary.dimensions} ({counts.embedded} embedded, {summary.skipped} "
        f"already there) in {summary.seconds:.1f} s, {counts.embedded / summary.seconds:.1f} texts/s; "
        f"{counts.retries} retries, {counts.reconnects} reconnects"
    )
    return 0


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--dimensions", type=_at_least(int, 0), default=0, help="0 (default): the model's")
    parser.add_argument("--ca-file", help="PEM CA bundle the server's certificate must chain to: turns TLS on")
    parser.add_argument("--cert-file", help="PEM client certificate, for a server that requires mTLS")
    parser.add_argument("--key-file", help="PEM private key of --cert-file")


def _at_least(kind: Callable[[str], Number], minimum: Number) -> Callable[[str], Number]:
    """An argparse type: a number of ``kind`` no smaller than ``minimum``."""

    def parse(value: str) -> Number:
        number = kind(value)
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return number

    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names it in "invalid int value"
    return parse


if __name__ == "__main__":
    sys.exit(main())
