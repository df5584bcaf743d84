"""OpenTelemetry spans of answered calls: a span per call, a child of the caller's trace context,
with a child per stage; recorded into the SDK's in-memory exporter, and exported over OTLP/HTTP by
a real server to a collector on loopback."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kembed.frontend import tracing
from kembed.frontend.call import EmbedResult, Timings
from kembed.frontend.quantize import Encoding
from kembed.plumbing import request_log
from kembed.v1 import embedder_pb2 as pb
from kembed.v1 import embedder_pb2_grpc as pb_grpc
from tests.server.serving import ServerProcess, serving, wait_until

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
STAGES = ["tokenize", "queue", "compute"]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing._tracer = None  # off again, as in a server without an endpoint


def result(timings: Timings) -> EmbedResult:
    return EmbedResult(np.zeros((2, 4), np.float32), np.array([3, 5], np.int32), "", timings, Encoding.FLOAT32, 4)


def test_a_call_s_span_continues_the_caller_s_trace_and_holds_its_stages(spans: InMemorySpanExporter):
    token = request_log.request_id.set("call-1")
    try:
        tracing.record("Embed", lambda: {"traceparent": TRACEPARENT}, result(Timings(0.02, 0.01, 0.05, 0.09)))
    finally:
        request_log.request_id.reset(token)
    *stages, call = spans.get_finished_spans()
    assert call.name == "Embed" and call.parent is not None
    assert (f"{call.context.trace_id:032x}", f"{call.parent.span_id:016x}") == (TRACE_ID, PARENT_ID)
    assert dict(call.attributes or {}) == {"kembed.request_id": "call-1", "kembed.items": 2, "kembed.tokens": 8}
    assert [stage.name for stage in stages] == STAGES
    assert all(stage.parent is not None and stage.parent.span_id == call.context.span_id for stage in stages)
    durations = [(stage.end_time or 0) - (stage.start_time or 0) for stage in stages]
    assert durations == pytest.approx([10e6, 20e6, 50e6], abs=2)  # tokenize, queue, compute: in order
    assert stages[0].start_time == call.start_time and (call.end_time or 0) - (call.start_time or 0) == 90_000_000


def test_stages_that_outlast_the_call_end_with_it(spans: InMemorySpanExporter):
    """A call over several batches computed at once: their compute time is their sum, longer than the call."""
    tracing.record("Embed", lambda: {}, result(Timings(0.0, 0.0, 0.3, 0.1)))
    *stages, call = spans.get_finished_spans()
    assert call.parent is None  # no trace context: a trace of its own
    assert stages[-1].end_time == call.end_time


def test_off_without_an_endpoint_and_no_carrier_is_read():
    assert tracing.start({}) is False
    tracing.record("Embed", lambda: pytest.fail("read while tracing is off"), result(Timings(0, 0, 0, 0)))


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace collector on loopback: every span it receives."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Receive)
        self.spans: list[Any] = []


class Receive(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.server.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced_server(collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # exported within 0.1 s
    with serving(Path(tmp_path_factory.mktemp("traced")), frontends=1, admission="", environ=environ) as server:
        yield server


def traced(collector: Collector, trace_id: str) -> dict[str, Any]:
    """The spans of ``trace_id`` the collector received, by name, once the call's and its stages' are in."""
    found: dict[str, Any] = {}

    def arrived() -> bool:
        found.update({span.name: span for span in collector.spans if span.trace_id.hex() == trace_id})
        return len(found) >= 1 + len(STAGES)

    wait_until(arrived, 30, f"the spans of trace {trace_id}")
    return found


@pytest.mark.process
def test_a_server_exports_each_call_s_spans_in_its_caller_s_trace(traced_server: ServerProcess, collector: Collector):
    with grpc.insecure_channel(traced_server.target) as channel:
        pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["hello"]), metadata=(("traceparent", TRACEPARENT),))
    spans = traced(collector, TRACE_ID)
    assert spans["Embed"].parent_span_id.hex() == PARENT_ID
    assert all(spans[stage].parent_span_id == spans["Embed"].span_id for stage in STAGES)
    rest_trace = "0af7651916cd43dd8448eb211c80319c"
    body = json.dumps({"input": ["hello"]}).encode()
    headers = {"Content-Type": "application/json", "traceparent": f"00-{rest_trace}-b7ad6b7169203331-01"}
    with urllib.request.urlopen(urllib.request.Request(traced_server.rest_url + "/embeddings", body, headers)):
        pass
    assert "POST /v1/embeddings" in traced(collector, rest_trace)
    stream_trace = "5b8aa5a2d2c872e8321cf37308d69df2"
    requests = [pb.EmbedRequest(texts=["hello"], request_id="a"), pb.EmbedRequest(texts=["bye"], request_id="b")]
    with grpc.insecure_channel(traced_server.target) as channel:
        stream = pb_grpc.EmbedderStub(channel).EmbedStream
        answers = list(stream(iter(requests), metadata=(("traceparent", f"00-{stream_trace}-b7ad6b7169203331-01"),)))
    assert sorted(answer.request_id for answer in answers) == ["a", "b"]  # in the order computed
    wait_until(
        lambda: sum(s.name == "EmbedStream" and s.trace_id.hex() == stream_trace for s in collector.spans) == 2,
        30,
        "a span per streamed request",
    )
