"""Retry markers at both edges of a real server over loopback: a refused call retried with a marker
(gRPC's own retry policy, the openai SDK's header) is counted once in ``kembed_demand_ratio``; one
without a marker counts again."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kembed.config.settings import Settings
from kembed.contract import OPENAI_RETRY_COUNT_HEADER, Metric
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, serving

pytestmark = pytest.mark.process
IDS = [101] + [2023] * 198 + [102]  # 200 ids: one item in the 256-token bucket
COST = 256
QUEUE_CAP = 260  # one such item fits; two do not, even with the interactive reserve
# gRPC's own retry policy (gRFC A6): a refusal is retried once, after the server's pushback, and
# the retry carries grpc-previous-rpc-attempts.
RETRYING = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "kembed.v1.Embedder"}],
                "retryPolicy": {
                    "maxAttempts": 2,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
                },
            }
        ]
    }
)


def request() -> pb.EmbedRequest:
    return pb.EmbedRequest(tokens=pb.TokenIds(ids=np.asarray(IDS, dtype=np.uint32).tobytes(), lengths=[len(IDS)]))


@pytest.fixture(scope="module")
def full_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One front end; its engine held with one call of COST queued, so every other call is refused."""
    folder = tmp_path_factory.mktemp("demand")
    with (
        serving(folder, held=True, frontends=1, max_queued_tokens=QUEUE_CAP) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        with server.engine:
            queued = pb_grpc.EmbedderStub(channel).Embed.future(request(), timeout=600)
            server.wait_open_requests(1)
            yield server
        queued.result()  # answered once released, before the server stops


def demand(server: ServerProcess) -> float:
    return server.metric(Metric.DEMAND_RATIO)


def one_call(server: ServerProcess) -> float:
    """What one call of COST adds to the gauge, read at once."""
    window_s = Settings.model_fields["demand_window_s"].default
    return COST / window_s / server.metric(Metric.CAPACITY)


def post(server: ServerProcess, headers: dict[str, str]) -> int:
    body = json.dumps({"input": [IDS]}).encode()
    call = urllib.request.Request(
        server.rest_url + "/embeddings", body, {"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(call, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_a_grpc_call_retried_by_grpcs_retry_policy_counts_once(full_server: ServerProcess) -> None:
    before = demand(full_server)
    options = [("grpc.service_config", RETRYING)]
    with grpc.insecure_channel(full_server.target, options=options) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.EmbedderStub(channel).Embed(request(), timeout=60)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    added = demand(full_server) - before
    # Twice the call would be two calls' worth; the gauge only decays between the two reads.
    assert 0 < added <= one_call(full_server) * 1.001
    assert full_server.metric('kembed_requests_total{api="grpc",code="RESOURCE_EXHAUSTED"}') == 2  # both attempts came


def test_a_rest_call_with_the_openai_sdks_retry_count_is_not_counted_again(full_server: ServerProcess) -> None:
    before = demand(full_server)
    assert post(full_server, {OPENAI_RETRY_COUNT_HEADER: "1"}) == 429
    marked = demand(full_server)
    assert marked <= before  # nothing added: only the decay since
    assert post(full_server, {}) == 429  # no marker: a call of its own
    assert demand(full_server) > marked
