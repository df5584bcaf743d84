"""Where the server listens: a bind address (``KEMBED_GRPC_HOST``, ``KEMBED_HTTP_HOST``) as a bound
socket, and written as gRPC's targets and URLs write it (an IPv6 address in brackets).

``::`` listens on both families where the host has IPv6: one socket with ``IPV6_V6ONLY`` off takes
IPv4 connections too, as mapped addresses (``::ffff:10.0.0.7``), as gRPC's core does for ``[::]``;
on a host without IPv6 it is ``0.0.0.0``, as in gRPC's core. The operator's pods bind ``::``, so
they listen on their address whether the cluster is IPv4, IPv6 or dual-stack.

A port of 0 is any free port, and the supervisor's first line names the ports it bound
(:func:`listening_ports` reads them): tests and benchmarks start servers so, never on a port
found free first and bound after (another process may take it meanwhile)."""

from __future__ import annotations

import errno
import re
import socket

from kembed.contract import ANY_ADDRESS, REST_ANY_PORT, env_name

ANY_IPV4 = "0.0.0.0"
_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)  # IPv6 not built in, or switched off


def bind(host: str, port: int, purpose: str, setting: str, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening; shared by every process that binds
    the port (``SO_REUSEPORT``) when ``reuse_port``. The error names the port, its ``purpose`` and
    the ``setting`` that moves it (none: ``""``): on a shared host the defaults clash, and the fix is
    one variable away."""
    try:
        return _bound(host, port, reuse_port)
    except OSError as error:
        if host == ANY_ADDRESS and error.errno in _NO_IPV6:
            return bind(ANY_IPV4, port, purpose, setting, reuse_port=reuse_port)
        hint = f" (set {env_name(setting)} to move it)" if setting else ""
        raise OSError(error.errno, f"{purpose} port {host_port(host, port)}: {error.strerror}{hint}") from None


def _bound(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP named: asyncio sets TCP_NODELAY
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT if reuse_port else socket.SO_REUSEADDR, 1)
        if host == ANY_ADDRESS:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:50051``): gRPC's target syntax and URLs'."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# The settings that bind every port to any free one (REST's 0 turns it off).
ANY_PORTS = {"grpc_port": 0, "rest_port": REST_ANY_PORT, "http_port": 0}

# The supervisor's first line (kembed/supervisor/process.py prints it): where each port listens.
_LISTENING = re.compile(
    r"^kembed: gRPC on \S+:(?P<grpc>\d+) \(.*?\), (?:OpenAI REST on https?://\S+:(?P<rest>\d+)/v1, )?"
    r"health and metrics on http://\S+:(?P<http>\d+) ",
    re.MULTILINE,
)


def listening_ports(output: str) -> dict[str, int] | None:
    """The ports a server's output says it listens on, by name (``grpc``, ``rest``: 0 when off,
    ``http``), once it has said so; None before."""
    found = _LISTENING.search(output)
    return None if found is None else {name: int(port or 0) for name, port in found.groupdict().items()}
