"""TLS settings, start-up checks and the rotation fetcher, in process with real certificates (no server)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kembed.config.settings import Settings
from kembed.config.values import ConfigError
from kembed.plumbing import tls
from tests.server.certs import Authority, write_atomically


@pytest.fixture(scope="module")
def ca() -> Authority:
    return Authority.create("kembed test CA")


@pytest.fixture
def files(tmp_path: Path, ca: Authority) -> tls.TlsFiles:
    cert, key = ca.issue("server").write(tmp_path, "tls")
    return tls.TlsFiles(cert, key, write_atomically(tmp_path / "ca.crt", ca.cert_pem))


def settings(files: tls.TlsFiles, **overrides: str) -> Settings:
    values = {"tls_cert_file": str(files.cert), "tls_key_file": str(files.key)}
    return Settings(**{**values, **overrides})


def test_settings_pair_cert_and_key() -> None:
    with pytest.raises(ConfigError, match="KEMBED_TLS_CERT_FILE and KEMBED_TLS_KEY_FILE"):
        Settings.from_env({"KEMBED_TLS_CERT_FILE": "/x/tls.crt"})
    with pytest.raises(ConfigError, match="KEMBED_TLS_CLIENT_CA_FILE needs KEMBED_TLS_CERT_FILE"):
        Settings.from_env({"KEMBED_TLS_CLIENT_CA_FILE": "/x/ca.crt"})
    assert not Settings().tls


def test_good_files_pass(files: tls.TlsFiles) -> None:
    tls.check(settings(files, tls_client_ca_file=str(files.client_ca)))
    tls.check(Settings())  # no TLS: nothing to check


def _swap_key(files: tls.TlsFiles, ca: Authority) -> None:
    write_atomically(files.key, ca.issue("someone else").key_pem)


def _garble_ca(files: tls.TlsFiles, ca: Authority) -> None:
    assert files.client_ca is not None
    files.client_ca.write_text("not a certificate")


def _remove_ca(files: tls.TlsFiles, ca: Authority) -> None:
    assert files.client_ca is not None
    files.client_ca.unlink()


BREAKAGES = {
    "missing cert": (lambda files, ca: files.cert.unlink(), "KEMBED_TLS_CERT_FILE"),
    "missing key": (lambda files, ca: files.key.unlink(), "KEMBED_TLS_KEY_FILE"),
    "missing client CA": (_remove_ca, "KEMBED_TLS_CLIENT_CA_FILE"),
    "cert not PEM": (lambda files, ca: files.cert.write_text("not a certificate"), "KEMBED_TLS_CERT_FILE"),
    "client CA not PEM": (_garble_ca, "KEMBED_TLS_CLIENT_CA_FILE"),
    "key of another cert": (_swap_key, "KEMBED_TLS_KEY_FILE"),
}


@pytest.mark.parametrize(("breakage", "variable"), BREAKAGES.values(), ids=BREAKAGES.keys())
def test_bad_files_name_the_variable(
    files: tls.TlsFiles, ca: Authority, breakage: Callable[[tls.TlsFiles, Authority], object], variable: str
) -> None:
    breakage(files, ca)
    with pytest.raises(ConfigError, match=f"^{variable}: "):
        tls.verify(files)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [("missing key", "KEMBED_TLS_KEY_FILE: cannot read"), ("key of another cert", "KEMBED_TLS_KEY_FILE: /")],
)
@pytest.mark.process
def test_start_up_fails_with_exit_2_naming_the_variable(
    files: tls.TlsFiles, ca: Authority, breakage: str, message: str
) -> None:
    BREAKAGES[breakage][0](files, ca)
    env = {"PATH": "/usr/bin:/bin", "KEMBED_TLS_CERT_FILE": str(files.cert), "KEMBED_TLS_KEY_FILE": str(files.key)}
    result = subprocess.run([sys.executable, "-m", "kembed"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"kembed: configuration error: {message}" in result.stderr
    assert breakage != "key of another cert" or "key values mismatch" in result.stderr


def test_fetcher_reloads_only_whole_changed_pairs(files: tls.TlsFiles, ca: Authority, tmp_path: Path) -> None:
    fetcher = tls.CertificateFetcher(files)
    first = fetcher.material
    assert fetcher() is None  # unchanged: gRPC keeps its configuration, no file is read

    write_atomically(files.cert, first.cert)  # rewritten with the same bytes: nothing to hand over
    assert fetcher() is None

    rotated = ca.issue("server, rotated")
    write_atomically(files.cert, rotated.cert_pem)  # half-way: the new certificate with the old key
    assert fetcher() is None
    assert fetcher.material == first

    write_atomically(files.key, rotated.key_pem)
    assert fetcher() is not None
    assert (fetcher.material.cert, fetcher.material.key) == (rotated.cert_pem, rotated.key_pem)
    assert fetcher() is None
