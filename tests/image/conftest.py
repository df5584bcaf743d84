"""The built images (``make image``) and whether podman can start a container on this machine.

An image that is not built fails its tests (``make image-test`` builds first); a machine where
podman cannot start a container skips them, naming podman's error.
"""

from __future__ import annotations

import shutil

import pytest

from images.build import IMAGES
from tests.image.podman import podman, ulimits


def built(name: str) -> str:
    tag = IMAGES[name].tag
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman buildah runc mmdebstrap)")
    if podman("image", "exists", tag).returncode != 0:
        pytest.fail(f"{tag} is not built: run `make image`")
    # /bin/true is in every Debian base: if it cannot run, podman cannot run a container here.
    probe = podman("run", "--rm", *ulimits(), "--entrypoint", "/bin/true", tag)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container on this machine: {probe.stderr.strip()}")
    return tag


@pytest.fixture(scope="session")
def server_image() -> str:
    return built("server")


@pytest.fixture(scope="session")
def operator_image() -> str:
    return built("operator")
