"""Where and how a client connects: the target, TLS files and channel options, in one place.

The library (:class:`~kembed.client.EmbedClient`), the one-shot CLI and the corpus command all take a
:class:`Connection`; the two commands read it from the same flags (:func:`add_arguments`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# What a message may weigh either way: the server's own default (KEMBED_MAX_MESSAGE_BYTES).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Connection:
    """A server to call: plaintext unless a CA or a client certificate is given (then TLS, and mTLS
    with ``cert_file`` and ``key_file``)."""

    target: str = DEFAULT_TARGET
    ca_file: str | None = None  # PEM CA bundle the server's certificate must chain to (None: the system's)
    cert_file: str | None = None  # PEM client certificate, for a server that requires mTLS
    key_file: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    round_robin: bool = False  # spread calls over every address the target's name resolves to

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        if self.round_robin:  # a headless Service's name resolves to every pod
            options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})))
        return options

    def channel(self) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(self.target, options=self.options())
        return grpc.secure_channel(self.target, self._credentials(), options=self.options())

    def aio_channel(self) -> grpc.aio.Channel:
        if not self.tls:
            return grpc.aio.insecure_channel(self.target, options=self.options())
        return grpc.aio.secure_channel(self.target, self._credentials(), options=self.options())

    def _credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)


def channel_credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS trusting ``ca_file`` (None: the system's roots), presenting ``cert_file``/``key_file`` for mTLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file), private_key=_read(key_file), certificate_chain=_read(cert_file)
    )


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection's flags, the same in every command."""
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help=f"HOST:PORT of the gRPC API (default {DEFAULT_TARGET})"
    )
    parser.add_argument("--ca-file", help="PEM CA bundle the server's certificate must chain to: turns TLS on")
    parser.add_argument("--cert-file", help="PEM client certificate, for a server that requires mTLS")
    parser.add_argument("--key-file", help="PEM private key of --cert-file")


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Connection:
    """The connection the flags name; a certificate without its key (or the reverse) is a usage error."""
    try:
        return Connection(args.target, ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
    except ValueError as error:
        parser.error(f"--cert-file, --key-file: {error}")
