"""Where and how a client connects: the target, TLS files, the API key and channel options, in one place.

The library (:class:`~kembed.client.EmbedClient`), the one-shot CLI and the corpus command all take a
:class:`Connection`; the two commands read it from the same flags (:func:`add_arguments`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# What a message may weigh either way: the server's own default (KEMBED_MAX_MESSAGE_BYTES).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# The server's setting: a file of keys, one a line. A client started where it is set sends the first.
API_KEY_FILE_VAR = "KEMBED_API_KEY_FILE"
# What a gRPC metadata value (and an HTTP header) may carry: printable ASCII, no spaces.
_KEY_PATTERN = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class Connection:
    """A server to call: plaintext unless a CA or a client certificate is given (then TLS, and mTLS
    with ``cert_file`` and ``key_file``); with ``api_key``, every call says ``authorization: Bearer KEY``."""

    target: str = DEFAULT_TARGET
    ca_file: str | None = None  # PEM CA bundle the server's certificate must chain to (None: the system's)
    cert_file: str | None = None  # PEM client certificate, for a server that requires mTLS
    key_file: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    round_robin: bool = False  # spread calls over every address the target's name resolves to
    # Sent as `authorization: Bearer KEY` on every call; kept out of the repr, which logs may show.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if self.api_key is not None:
            _check_key(self.api_key)

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

    def aio_channel(self) -> grpc.aio.Channel:
        # An interceptor, not call credentials: gRPC sends those over TLS only, and a key must reach
        # a plaintext server too (one behind a mesh that terminates TLS, a test on loopback).
        key = self.api_key
        # Any: grpc-stubs types an interceptor as a partial stub that takes no class of its own.
        interceptors: list[Any] | None = None if key is None else [_UnaryBearer(key), _StreamBearer(key)]
        if not self.tls:
            return grpc.aio.insecure_channel(self.target, options=self.options(), interceptors=interceptors)
        return grpc.aio.secure_channel(
            self.target, self._credentials(), options=self.options(), interceptors=interceptors
        )

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


def read_api_key(path: str) -> str:
    """The first key in a file of keys, one a line (the server's format; the others are for rotation)."""
    text = Path(path).read_text(encoding="ascii", errors="replace")
    key = next((line.strip() for line in text.splitlines() if line.strip()), None)
    if key is None:
        raise ValueError(f"{path} holds no key")
    return _check_key(key)


def _check_key(key: str) -> str:
    if not _KEY_PATTERN.fullmatch(key):
        raise ValueError("an API key is printable ASCII without spaces")
    return key


class _Bearer:
    """Adds the API key to a call's metadata, beside any of its own (a retry marker, say)."""

    def __init__(self, key: str) -> None:
        self._key = key

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), ("authorization", f"Bearer {self._key}"))
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]


# One interceptor a call kind (a channel files each under the first kind it is): Info and Embed are
# unary, EmbedStream a stream both ways; the API has no other kind.
class _UnaryBearer(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamBearer(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection's flags, the same in every command."""
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help=f"HOST:PORT of the gRPC API (default {DEFAULT_TARGET})"
    )
    parser.add_argument("--ca-file", help="PEM CA bundle the server's certificate must chain to: turns TLS on")
    parser.add_argument("--cert-file", help="PEM client certificate, for a server that requires mTLS")
    parser.add_argument("--key-file", help="PEM private key of --cert-file")
    parser.add_argument(
        "--api-key-file",
        default=os.environ.get(API_KEY_FILE_VAR),
        help=f"a file of API keys, one a line (the server's format): the first is sent as `authorization: Bearer "
        f"KEY` (default: ${API_KEY_FILE_VAR}, the server's own setting, where it is set)",
    )


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Connection:
    """The connection the flags name; a certificate without its key (or the reverse), or a key file that
    cannot be read or holds no key, is a usage error."""
    try:
        api_key = None if args.api_key_file is None else read_api_key(args.api_key_file)
    except (OSError, ValueError) as error:
        parser.error(f"--api-key-file: {error}")
    try:
        return Connection(
            args.target, ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file, api_key=api_key
        )
    except ValueError as error:
        parser.error(f"--cert-file, --key-file: {error}")
