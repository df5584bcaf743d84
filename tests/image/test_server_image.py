"""The CPU server image as built (``make image``), started as the operator's Deployment runs it:
read-only root, /tmp and the compile cache on emptyDirs (tmpfs here), uid 10001, no capabilities,
no privilege escalation, the Deployment's environment and memory limit.

It becomes ready, serves the same vectors over gRPC and the OpenAI API as a server started from the
working tree, reports healthy, and drains on SIGTERM without losing a call it accepted. The spec
turns admission off, so that every call of the drain test is accepted and still in flight when
SIGTERM arrives (with admission on, a burst is mostly refused and the rest done in a second), and
asks for the reference server's small shapes, so that both warm up quickly.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from kembed.client import decode
from kembed.contract import COMPILING, GRPC_PORT, HTTP_PORT, LIVEZ_PATH, REST_PORT
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from kembed_operator import kinds, render
from kembed_operator.config import OperatorConfig
from kembed_operator.spec import parse_spec
from tests.image.podman import Container, http_status, image_files, podman
from tests.operator.conftest import free_port
from tests.server.serving import FAST, ServerProcess, wait_until

pytestmark = [pytest.mark.image, pytest.mark.process, pytest.mark.timeout(900)]

# The reference server's small shapes (quick warmups on a shared machine), in the spec's words.
BATCHING = {"buckets": [int(b) for b in str(FAST["buckets"]).split(",")], "maxBatchSize": FAST["max_batch_size"]}
BATCHING["maxTokensPerBatch"] = FAST["max_tokens_per_batch"]
SPEC = {"resources": {"gpu": 0, "cpu": "2", "memory": "4Gi"}, "admission": {"strategies": []}, "batching": BATCHING}
TEXTS = ["hello world", "Kubernetes schedules pods onto nodes.", "naïve café, 東京, emoji 🚀", "A short one."]
PARAGRAPH = "Readiness goes false at once, and everything accepted is finished and answered. " * 6
# 1.16 GB without a compiler, plus the compiler inductor builds a CPU's forward with (280 MB) and
# torch's C++ headers (39 MB): 1.49 GB built.
MAX_SIZE_BYTES = 1_500_000_000
# What a CPU image must not carry: build tools beyond the compiler inductor runs (gcc, g++ and their
# binutils), an installer, and anything of the build machine's pip settings (carried in as secrets
# and loopback URLs, never into a layer).
TOOLS = r"(clang|clang\+\+|make|cmake|ninja|protoc)"
BUILD_TOOL = re.compile(rf"^/usr/(local/)?s?bin/(x86_64-linux-gnu-)?{TOOLS}(-[\d.]+)?$")
BUILD_TOOL_IN_VENV = re.compile(r"^/opt/venv/bin/(pip.*|protoc.*)$")
LEFTOVERS = ["/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more", "/run/secrets"]
LEFTOVERS += ["/root/.cache", "/root/.config", "/src", "/opt/build"]


def deployment() -> dict[str, Any]:
    owner = render.Owner(name="kembed", namespace="default", uid="image-test")
    children = render.render(owner, parse_spec(SPEC), OperatorConfig(default_image="unused"))
    (manifest,) = [child.manifest for child in children if child.kind == kinds.DEPLOYMENT]
    return manifest


def http(port: int, path: str) -> int:
    return http_status(f"http://127.0.0.1:{port}{path}")


class Server:
    """The image running as the Deployment's pod, on free loopback ports."""

    def __init__(self, image: str) -> None:
        self.pod = deployment()["spec"]["template"]["spec"]
        (self.container,) = self.pod["containers"]
        self.ports = {port["name"]: free_port() for port in self.container["ports"]}
        self.started = time.monotonic()
        self.run = Container(image, self.pod, self.container, self.ports)
        self.start_to_ready_s = 0.0

    def wait_ready(self) -> Server:
        """Until the Deployment's startup probe would pass."""
        if not self.start_to_ready_s:
            probe = self.container["startupProbe"]["httpGet"]
            ready = lambda: http(self.ports[probe["port"]], probe["path"]) == 200 or not self.run.running()  # noqa: E731
            wait_until(ready, 600, "the image's startup probe")
            assert self.run.running(), self.run.logs()
            self.start_to_ready_s = time.monotonic() - self.started
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['rest']}/v1"

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['http']}/health", timeout=10) as response:
            return dict(json.loads(response.read()))


@pytest.fixture(scope="module", autouse=True)
def starting(server_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, ServerProcess]]:
    """The image and, beside it, ``python -m kembed`` from the working tree (as ``make serve`` starts
    it), both started at once, while the tests that need neither run."""
    image = Server(server_image)
    tree = ServerProcess(tmp_path_factory.mktemp("reference") / "server.log")
    try:
        yield image, tree
    finally:
        tree.stop()
        print(image.run.logs()[-4000:])
        image.run.remove()


@pytest.fixture(scope="module")
def server(starting: tuple[Server, ServerProcess]) -> Server:
    running = starting[0].wait_ready()
    print(f"start to ready: {running.start_to_ready_s:.1f} s (beside the reference server's own start)")
    return running


@pytest.fixture(scope="module")
def reference(starting: tuple[Server, ServerProcess]) -> ServerProcess:
    return starting[1].wait_ready()


def test_the_image_carries_the_contract(server_image: str) -> None:
    """EXPOSE and HEALTHCHECK survive the build (--format docker) and match kembed.contract."""
    (config,) = json.loads(podman("image", "inspect", server_image).stdout)
    exposed = set(config["Config"]["ExposedPorts"])
    assert exposed == {f"{port}/tcp" for port in (GRPC_PORT, REST_PORT, HTTP_PORT)}
    assert f"http://127.0.0.1:{HTTP_PORT}{LIVEZ_PATH}" in " ".join(config["Healthcheck"]["Test"])
    assert config["Config"]["User"] == f"{render.RUN_AS}:{render.RUN_AS}"
    assert not [var for var in config["Config"]["Env"] if var.startswith("PIP_")]
    assert config["Size"] <= MAX_SIZE_BYTES, f"{config['Size'] / 1e9:.2f} GB"


def test_the_compiler_inductor_runs_no_other_build_tools_nothing_of_the_build_machine(server_image: str) -> None:
    files = image_files(server_image)
    assert "/usr/bin/g++" in files or any(re.match(r"^/usr/bin/g\+\+-[\d.]+$", path) for path in files)
    assert [path for path in files if path.endswith("/Python.h")]
    assert [path for path in files if path.endswith("/torch/include/torch/csrc/inductor/cpp_prefix.h")]
    assert not [path for path in files if BUILD_TOOL.match(path) or BUILD_TOOL_IN_VENV.match(path)]
    assert not [path for path in files if "/site-packages/pip/" in path]
    assert not [path for path in LEFTOVERS if path in files or any(f.startswith(path + "/") for f in files)]
    assert not [path for path in files if path.endswith("/pip.conf")]
    assert not [path for path in files if path.startswith("/tmp/")]  # where the build's mounts were
    assert [path for path in files if re.search(r"/site-packages/torch-[\d.]+\+cpu\.dist-info/METADATA$", path)]


def test_same_vectors_as_the_working_tree_over_grpc_and_the_openai_api(
    server: Server, reference: ServerProcess
) -> None:
    request = pb.EmbedRequest(texts=TEXTS)
    with grpc.insecure_channel(server.target) as image, grpc.insecure_channel(reference.target) as tree:
        from_image = decode(pb_grpc.EmbedderStub(image).Embed(request, timeout=60))
        from_tree = decode(pb_grpc.EmbedderStub(tree).Embed(request, timeout=60))
    assert from_image.shape == from_tree.shape == (len(TEXTS), 384)
    assert np.min(np.sum(from_image * from_tree, axis=1)) >= 0.9999

    def openai_vectors(base_url: str) -> np.ndarray:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        (model,) = [model.id for model in client.models.list()]
        response = client.embeddings.create(model=model, input=TEXTS)
        return np.asarray([item.embedding for item in response.data], dtype=np.float32)

    rest_image, rest_tree = openai_vectors(server.rest_url()), openai_vectors(reference.rest_url)
    assert np.min(np.sum(rest_image * rest_tree, axis=1)) >= 0.9999
    assert np.min(np.sum(rest_image * from_tree, axis=1)) >= 0.9999


def test_compiles_its_forward_as_non_root_on_a_read_only_root(server: Server) -> None:
    """Inductor builds a CPU's forward with the image's g++, into the compile cache's emptyDir: the
    compile beside serving ends with figures, not with a failure."""
    wait_until(lambda: COMPILING not in server.health()["forward_reason"], 900, "the compile beside serving")
    why = server.health()["forward_reason"]
    assert "compile failed" not in why and "eager's speed" in why, why


def test_reports_healthy(server: Server) -> None:
    done = podman("healthcheck", "run", server.run.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert http(server.ports["http"], LIVEZ_PATH) == 200


def test_sigterm_answers_every_accepted_call(server: Server) -> None:
    """Runs last: it stops the module's container."""
    count = 8
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        calls = [stub.Embed.future(pb.EmbedRequest(texts=[PARAGRAPH] * 8), timeout=300) for _ in range(count)]
        wait_until(lambda: server.health()["open_requests"] + sum(c.done() for c in calls) == count, 120, "admission")
        in_flight = [call for call in calls if not call.done()]
        stopping = threading.Thread(target=server.run.stop)
        stopping.start()
        assert in_flight, "every call was answered before SIGTERM: nothing was in flight to drain"
        wait_until(lambda: http(server.ports["http"], "/readyz") != 200, 60, "readiness to drop")
        answered = [call.result().count for call in calls]  # raises if one was lost
        stopping.join()
    assert answered == [8] * count
    assert server.run.inspect("{{.State.ExitCode}}") == "0"  # drained in time: no SIGKILL (137)
    assert "draining" in server.run.logs()
    print(f"{len(in_flight)} of {count} calls in flight at SIGTERM, all answered")
