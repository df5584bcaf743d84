"""``make image``'s carrying of pip's settings into a build: rewritten to secrets and loopback URLs,
and served read-only, without podman (the image tests show a build that used them)."""

from __future__ import annotations

import configparser
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from images import build


@pytest.fixture
def machine(tmp_path: Path) -> dict[str, dict[str, str]]:
    """pip settings like this machine's: a CA bundle, a wheel folder, file:// indexes, constraints."""
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"wheel")
    (tmp_path / "pypi" / "simple" / "numpy").mkdir(parents=True)
    (tmp_path / "pypi" / "simple" / "numpy" / "index.html").write_text('<a href="../../files/numpy.whl">numpy</a>')
    (tmp_path / "pypi" / "files").mkdir()
    (tmp_path / "pypi" / "files" / "numpy.whl").write_bytes(b"numpy")
    (tmp_path / "constraints.txt").write_text("torch<=2.14.1\n")
    (tmp_path / "ca.crt").write_text("CA")
    return {
        "global": {
            "cert": str(tmp_path / "ca.crt"),
            "find-links": str(tmp_path / "wheels"),
            "extra-index-url": f"file://{tmp_path}/pypi/simple https://example.org/simple",
            "constraint": str(tmp_path / "constraints.txt"),
            "default-timeout": "180",
        },
        "install": {"no-compile": "false"},
    }


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


def test_settings_become_secrets_and_loopback_urls(machine: dict[str, dict[str, str]], tmp_path: Path) -> None:
    served: dict[str, Path] = {}
    text, secrets = build.carry(machine, "http://127.0.0.1:9", served)
    conf = configparser.ConfigParser()
    conf.read_string(text)
    assert secrets == {build.CERT_SECRET: tmp_path / "ca.crt"}
    assert conf["global"]["cert"] == f"/tmp/{build.CERT_SECRET}"
    assert conf["global"]["find-links"] == "http://127.0.0.1:9/0/"
    assert conf["global"]["extra-index-url"] == "http://127.0.0.1:9/1/simple/ https://example.org/simple"
    assert conf["global"]["constraint"] == "http://127.0.0.1:9/2/constraints.txt"
    assert conf["global"]["trusted-host"] == "127.0.0.1"
    assert (conf["global"]["default-timeout"], conf["install"]["no-compile"]) == ("180", "false")
    assert served == {"0": tmp_path / "wheels", "1": tmp_path / "pypi", "2": tmp_path / "constraints.txt"}
    assert str(tmp_path) not in text  # nothing in the build names a path of this machine


def test_only_what_lies_below_a_served_folder_and_anyone_may_read(
    machine: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    (tmp_path / "wheels" / "private.whl").write_bytes(b"secret")
    (tmp_path / "wheels" / "private.whl").chmod(0o600)
    with build.serving() as (url, served):
        text, _ = build.carry(machine, url, served)
        index = text.split("extra-index-url = ")[1].split()[0]
        assert fetch(f"{index}numpy/") == (200, b'<a href="../../files/numpy.whl">numpy</a>')
        assert fetch(f"{index}numpy/../../files/numpy.whl") == (200, b"numpy")  # as pip resolves the link
        listing = fetch(f"{url}/0/")[1].decode()
        assert "torch-2.13.0%2Bcpu-cp311" in listing or "torch-2.13.0+cpu-cp311" in listing
        assert fetch(f"{url}/0/private.whl")[0] == 404
        assert fetch(f"{url}/0/../ca.crt")[0] == 404
        assert fetch(f"{url}/0/%2e%2e/ca.crt")[0] == 404
        assert fetch(f"{url}/2/constraints.txt") == (200, b"torch<=2.14.1\n")
        assert fetch(f"{url}/2/ca.crt")[0] == 404  # a file is served alone, not its folder
        assert fetch(f"{url}/9/anything")[0] == 404
        assert fetch(f"{url}/etc/passwd")[0] == 404


def test_a_stand_in_only_for_a_debian_slim_base() -> None:
    with pytest.raises(SystemExit, match="no stand-in"):
        build.stand_in("docker.io/library/python:3.11-slim")


def test_build_args_are_the_dockerfiles_defaults() -> None:
    args = build.build_args("Dockerfile.server")
    assert args["BASE"] == build.build_args("Dockerfile.operator")["BASE"]  # one base, one shared cache
    assert args["TORCH_BUILD"] == "cpu"
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/${TORCH_BUILD}"
