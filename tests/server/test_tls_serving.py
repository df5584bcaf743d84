"""TLS end to end: a real server on loopback with certificates from a throwaway CA, real gRPC clients.

One server serves TLS and one mTLS (client certificates required); each uses one front end, as
every front end builds the same credentials. Rotation rewrites the files as the kubelet does (a new
inode) while a call is in flight on a connection made with the old certificate (the engine is held
until the rotation has been checked, so the call is still in flight on any machine).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509

from kembed.client import EmbedClient
from kembed.client.connection import channel_credentials
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.certs import Authority, Issued, write_atomically
from tests.server.serving import ServerProcess, serving

pytestmark = pytest.mark.process

TEXTS = ["Rotation must not cut a call that is already being answered."] * 8


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca: Authority
    stranger: Authority  # a CA the servers do not know
    client: Issued

    @property
    def ca_file(self) -> str:
        return str(self.folder / "ca.crt")

    def stranger_file(self) -> str:
        return str(write_atomically(self.folder / "stranger.crt", self.stranger.cert_pem))

    def client_files(self, issued: Issued | None = None) -> tuple[str, str]:
        cert, key = (issued or self.client).write(self.folder, "client")
        return str(cert), str(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = Authority.create("kembed test CA")
    write_atomically(folder / "ca.crt", ca.cert_pem)
    return Pki(folder, ca, Authority.create("a stranger's CA"), ca.issue("client", client=True))


@contextlib.contextmanager
def tls_serving(folder: Path, pki: Pki, **settings: str) -> Iterator[ServerProcess]:
    cert, key = pki.ca.issue("kembed server").write(folder, "tls")
    values = {"tls_cert_file": str(cert), "tls_key_file": str(key), **settings}
    with serving(folder, held=True, frontends=1, admission="", **values) as server:
        yield server


@pytest.fixture(scope="module")
def server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with tls_serving(tmp_path_factory.mktemp("tls"), pki) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with tls_serving(tmp_path_factory.mktemp("mtls"), pki, tls_client_ca_file=pki.ca_file) as server:
        yield server


def info_code(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """One Info call on a fresh connection: OK, or the status it failed with."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # never reuse another test's connection
    channel = (
        grpc.insecure_channel(target, options)
        if credentials is None
        else grpc.secure_channel(target, credentials, options)
    )
    with channel:
        try:
            pb_grpc.EmbedderStub(channel).Info(pb.InfoRequest(), timeout=10)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def served_certificate(port: int) -> x509.Certificate:
    """The certificate a new TLS connection to ``port`` is shown (no verification: just look)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_a_tls_call_works(server: ServerProcess, pki: Pki) -> None:
    with EmbedClient(server.target, ca_file=pki.ca_file) as client:
        assert client.embed(["hello over TLS"]).shape == (1, 384)


def test_a_plaintext_call_fails_and_harms_no_one(server: ServerProcess, pki: Pki) -> None:
    assert info_code(server.target, None) is grpc.StatusCode.UNAVAILABLE
    assert info_code(server.target, channel_credentials(pki.ca_file)) is grpc.StatusCode.OK


def test_a_client_trusting_another_ca_fails(server: ServerProcess, pki: Pki) -> None:
    assert info_code(server.target, channel_credentials(pki.stranger_file())) is grpc.StatusCode.UNAVAILABLE


def test_the_http_port_stays_plaintext(server: ServerProcess) -> None:
    assert server.http("/readyz")[0] == 200
    assert server.http("/metrics")[0] == 200


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: ServerProcess, pki: Pki) -> None:
    assert info_code(mtls_server.target, channel_credentials(pki.ca_file)) is grpc.StatusCode.UNAVAILABLE
    outsider = pki.client_files(pki.stranger.issue("outsider", client=True))
    assert info_code(mtls_server.target, channel_credentials(pki.ca_file, *outsider)) is grpc.StatusCode.UNAVAILABLE
    cert, key = pki.client_files()
    with EmbedClient(mtls_server.target, ca_file=pki.ca_file, cert_file=cert, key_file=key) as client:
        assert client.embed(["hello over mTLS"]).shape == (1, 384)


def test_the_cli_speaks_mtls(mtls_server: ServerProcess, pki: Pki) -> None:
    cert, key = pki.client_files()
    tls_args = ["--ca-file", pki.ca_file, "--cert-file", cert, "--key-file", key]
    result = subprocess.run(
        [sys.executable, "-m", "kembed.client", "--target", mtls_server.target, *tls_args, "hello"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "1 x 384" in result.stdout


def test_the_corpus_command_speaks_mtls(mtls_server: ServerProcess, pki: Pki, tmp_path: Path) -> None:
    cert, key = pki.client_files()
    corpus, output = tmp_path / "corpus.txt", tmp_path / "vectors.npy"
    corpus.write_text("one\ntwo over mTLS\nthree\n")
    tls_args = ["--ca-file", pki.ca_file, "--cert-file", cert, "--key-file", key]
    flags = ["--input", str(corpus), "--output", str(output), "--no-progress"]
    command = [sys.executable, "-m", "kembed.client", "embed", "--target", mtls_server.target, *tls_args, *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with EmbedClient(mtls_server.target, ca_file=pki.ca_file, cert_file=cert, key_file=key) as client:
        expected = client.embed(["one", "two over mTLS", "three"], truncate=True)
    np.testing.assert_allclose(np.load(output), expected, atol=1e-5)


def test_rotation_switches_the_certificate_while_a_call_completes(server: ServerProcess, pki: Pki) -> None:
    folder = server.log.parent
    before = served_certificate(server.grpc_port)
    rotated_ca = Authority.create("kembed test CA, rotated")
    with EmbedClient(server.target, ca_file=pki.ca_file) as old, ThreadPoolExecutor(1) as pool:
        old.embed(["connect with the old certificate"])
        try:
            with server.engine:
                in_flight = pool.submit(old.embed, TEXTS)
                server.wait_open_requests(1)
                rotated_ca.issue("kembed server, rotated").write(folder, "tls")
                assert served_certificate(server.grpc_port).serial_number != before.serial_number
                rotated_file = str(write_atomically(folder / "rotated-ca.crt", rotated_ca.cert_pem))
                assert info_code(server.target, channel_credentials(rotated_file)) is grpc.StatusCode.OK
                assert info_code(server.target, channel_credentials(pki.ca_file)) is grpc.StatusCode.UNAVAILABLE
                assert not in_flight.done()  # the engine is held: the call spans the rotation
            assert in_flight.result(timeout=120).shape == (len(TEXTS), 384)
            assert old.retries == 0  # answered on the connection it started on, not retried
        finally:
            pki.ca.issue("kembed server").write(folder, "tls")  # back to the CA the other tests trust
    assert info_code(server.target, channel_credentials(pki.ca_file)) is grpc.StatusCode.OK
    assert "TLS certificate reloaded" in server.output()
