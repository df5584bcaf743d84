"""One request's story, as an operator reads it: its id (the caller's ``x-request-id``, else one
made) in its answer and in the log lines about it in both processes, TEI's timing headers on REST
and in gRPC's trailing metadata, and a histogram per stage; over loopback against a real server."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, server_fixture, wait_until

pytestmark = pytest.mark.process

# DEBUG: a line per answered call in the front end, per admitted request in the engine.
server = server_fixture(frontends=1, admission="", log_level="DEBUG")
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
TIMING_KEYS = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")
STAGES = ("tokenize", "queue", "compute")
# One batch (FAST's max_batch_size): a call over several batches computes some at once, and its
# inference time, their sum, can exceed its total.
TEXTS = [f"note {i} on pods, nodes and the queues between them" for i in range(16)]


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.EmbedderStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.EmbedderStub(channel)


def rest(server: ServerProcess, texts: list[str], request_id: str | None = None) -> tuple[Any, float]:
    """The answer's headers, and the client's latency until they arrived."""
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    body = json.dumps({"model": MODEL_ID, "input": texts, "encoding_format": "base64"}).encode()
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(server.rest_url + "/embeddings", body, headers)) as answer:
        latency = time.perf_counter() - started
        answer.read()
        return answer.headers, latency


def lines_of(server: ServerProcess, request_id: str) -> dict[str, list[str]]:
    """The log lines naming ``request_id``, by process (``engine``, ``frontend-0``), once both wrote one."""
    found: dict[str, list[str]] = {}

    def both() -> bool:
        found.clear()
        for line in server.output().splitlines():
            if f"[{request_id}] " in line:
                found.setdefault(line.split()[3], []).append(line)
        return {"engine", "frontend-0"} <= set(found)

    wait_until(both, 30, f"log lines of {request_id} from both processes")
    return found


def test_a_rest_call_s_id_is_answered_and_names_its_lines_in_both_processes(server: ServerProcess):
    headers, _ = rest(server, ["hello"], "story-rest-1")
    assert headers["X-Request-Id"] == "story-rest-1"
    lines = lines_of(server, "story-rest-1")
    assert any("answered: 1 items" in line for line in lines["frontend-0"])
    assert any("admitted: 1 items" in line for line in lines["engine"])


def test_a_call_without_an_id_gets_one_made(server: ServerProcess):
    headers, _ = rest(server, ["hello"], "two words")  # a space could forge a line's fields: replaced
    made = headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made), made
    assert lines_of(server, made)


def test_a_grpc_call_takes_its_metadata_s_id_and_answers_it_with_the_timings(
    server: ServerProcess, stub: pb_grpc.EmbedderStub
):
    answer, call = stub.Embed.with_call(
        pb.EmbedRequest(texts=["hello", "world"], request_id="7"), metadata=(("x-request-id", "story-grpc-1"),)
    )
    trailing = dict(call.trailing_metadata())
    assert trailing["x-request-id"] == "story-grpc-1" and answer.request_id == "7"  # the message's echoed as ever
    assert int(trailing["x-total-time"]) == round(answer.timings.total_ms)
    assert int(trailing["x-compute-tokens"]) == sum(answer.token_counts)
    assert {"engine", "frontend-0"} <= set(lines_of(server, "story-grpc-1"))


def test_a_grpc_call_without_metadata_is_named_by_its_message(server: ServerProcess, stub: pb_grpc.EmbedderStub):
    _, call = stub.Embed.with_call(pb.EmbedRequest(texts=["hello"], request_id="story-grpc-2"))
    assert dict(call.trailing_metadata())["x-request-id"] == "story-grpc-2"
    assert lines_of(server, "story-grpc-2")


def test_a_stream_s_requests_are_named_by_the_stream_and_their_own_id(
    server: ServerProcess, stub: pb_grpc.EmbedderStub
):
    requests = iter([pb.EmbedRequest(texts=["a"], request_id="1"), pb.EmbedRequest(texts=["b"], request_id="2")])
    answers = stub.EmbedStream(requests, metadata=(("x-request-id", "story-stream"),))
    assert sorted(answer.request_id for answer in answers) == ["1", "2"]
    assert dict(answers.trailing_metadata())["x-request-id"] == "story-stream"
    assert lines_of(server, "story-stream:1") and lines_of(server, "story-stream:2")


def test_the_timing_headers_add_up_to_what_the_client_waited(server: ServerProcess):
    """On an idle server the stages' sum is the client's latency within 10% (the issue's target),
    and the total within it; the best of five calls, so a busy machine's slow turn does not decide."""
    ratios = []
    for _ in range(5):
        headers, latency = rest(server, TEXTS)
        total, *stages = (int(headers[key]) for key in TIMING_KEYS)
        assert sum(stages) <= total + len(stages) <= 1000 * latency + 1 + len(stages)  # each rounded to a ms
        assert int(headers["x-compute-tokens"]) > len(TEXTS)
        ratios.append(sum(stages) / (1000 * latency))
    print(f"timing headers' sum over the client's latency: {sorted(ratios)}")
    assert max(ratios) >= 0.9, ratios


def test_each_stage_has_its_histogram(server: ServerProcess):
    before = {stage: server.metric(f'kembed_request_stage_seconds_count{{stage="{stage}"}}') for stage in STAGES}
    rest(server, ["hello"])
    wait_until(
        lambda: all(server.metric(f'kembed_request_stage_seconds_count{{stage="{s}"}}') > before[s] for s in STAGES),
        30,
        "a sample in each stage's histogram",
    )
