"""TLS for the gRPC and REST ports: checked once at start-up, re-read on rotation without a restart.

cert-manager (through the kubelet) rewrites a mounted Secret by swapping a symlink, so the files
change under a running server. gRPC asks :class:`CertificateFetcher` before every new handshake;
it looks at the files' stat, reads them only when that changed, and hands gRPC the new pair once
it is whole and matching. Connections already open keep their session, so calls in flight finish.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.contract import env_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None

    @classmethod
    def of(cls, settings: Settings) -> TlsFiles | None:
        if not settings.tls:
            return None
        ca = Path(settings.tls_client_ca_file) if settings.tls_client_ca_file else None
        return cls(Path(settings.tls_cert_file), Path(settings.tls_key_file), ca)

    def named(self) -> dict[str, Path]:
        """Each file by the variable that names it, for messages."""
        files = {env_name("tls_cert_file"): self.cert, env_name("tls_key_file"): self.key}
        if self.client_ca is not None:
            files[env_name("tls_client_ca_file")] = self.client_ca
        return files


@dataclass(frozen=True)
class Material:
    """The files' bytes: what gRPC is given."""

    cert: bytes
    key: bytes
    client_ca: bytes | None

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.client_ca)


def check(settings: Settings) -> None:
    """Start-up: every file readable, the key matching the certificate; else :class:`ConfigError`."""
    files = TlsFiles.of(settings)
    if files is not None:
        verify(files)


def verify(files: TlsFiles) -> None:
    """:class:`ConfigError` naming the variable whose file is missing or wrong."""
    for variable, path in files.named().items():
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{variable}: cannot read {path}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert, key, ca = env_name("tls_cert_file"), env_name("tls_key_file"), env_name("tls_client_ca_file")
    _load(context.load_verify_locations, cert, f"no PEM certificate in {files.cert}", cafile=files.cert)
    if files.client_ca is not None:
        _load(context.load_verify_locations, ca, f"no PEM certificate in {files.client_ca}", cafile=files.client_ca)
    detail = f"{files.key} is not a PEM private key (unencrypted) of the certificate in {cert}"
    _load(context.load_cert_chain, key, detail, files.cert, files.key, password=_no_password)


def _load(method: Callable[..., object], variable: str, detail: str, *args: object, **kwargs: object) -> None:
    try:
        method(*args, **kwargs)
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(f"{variable}: {detail} ({error})") from None


def _no_password() -> bytes:
    # Without this callback OpenSSL would prompt on the terminal for an encrypted key.
    return b""


def read(files: TlsFiles) -> Material:
    ca = files.client_ca.read_bytes() if files.client_ca is not None else None
    return Material(files.cert.read_bytes(), files.key.read_bytes(), ca)


class CertificateFetcher:
    """Watches the files: ``changed()`` gives their new contents once they changed and are usable;
    called, it is gRPC's certificate-configuration fetcher (a new configuration, else None)."""

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._seen = self._stamp()
        self.material = read(files)

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        """What a rewrite changes: inode (a symlink swap), size and modification time of each file."""
        stats = (os.stat(path) for path in self._files.named().values())
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        material = self.changed()
        return None if material is None else material.configuration()

    def changed(self) -> Material | None:
        try:
            stamp = self._stamp()
            if stamp == self._seen:
                return None
            verify(self._files)  # half-written (new cert, old key): keep serving the old pair
            material = read(self._files)
            if self._stamp() != stamp:  # changed again while being read: the next handshake looks again
                return None
        except (OSError, ConfigError) as error:
            log.warning("TLS files changed but are not usable yet, keeping the current certificate: %s", error)
            return None
        self._seen = stamp
        if material == self.material:
            return None
        self.material = material
        log.info("TLS certificate reloaded from %s", self._files.cert)
        return material


class ServerContext:
    """An ``ssl.SSLContext`` for a server socket that follows the files: ``refresh()`` reloads the
    certificate into it once they changed (new connections get the new one; open ones keep theirs)."""

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._fetcher = CertificateFetcher(files)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(files.cert, files.key, password=_no_password)
        if files.client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(cafile=files.client_ca)

    def refresh(self) -> None:
        if self._fetcher.changed() is not None:
            self.context.load_cert_chain(self._files.cert, self._files.key, password=_no_password)


def add_port(server: grpc.aio.Server, address: str, settings: Settings) -> None:
    """Listen on ``address``: TLS only when TLS is configured (with mTLS when a client CA is), else plaintext."""
    files = TlsFiles.of(settings)
    if files is None:
        server.add_insecure_port(address)
        return
    fetcher = CertificateFetcher(files)
    # grpc-stubs leave out the None (no change) that gRPC's own docs allow the fetcher to return.
    fetch = cast("Callable[[], grpc.ServerCertificateConfiguration]", fetcher)
    credentials = grpc.dynamic_ssl_server_credentials(
        fetcher.material.configuration(), fetch, require_client_authentication=files.client_ca is not None
    )
    server.add_secure_port(address, credentials)
