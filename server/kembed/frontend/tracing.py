"""OpenTelemetry spans of answered calls, exported over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT``
is set (the SDK's own variables, ``OTEL_SERVICE_NAME`` and the exporter's, apply) and the ``otel``
extra is installed.

A call's span is a child of the caller's trace context (W3C ``traceparent``), named by its request
id, with a child per stage (tokenize, queue, compute) drawn after the answer from the timings the
service measured: tracing adds no work inside the call's path, and none at all when it is off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from kembed.frontend.call import EmbedResult
from kembed.plumbing import request_log

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_tracer: Any = None  # an opentelemetry Tracer once start() found an endpoint; None: off


class TracingUnavailable(RuntimeError):
    """An endpoint is set, but the ``otel`` extra is not installed."""


def start(environ: Mapping[str, str] = os.environ) -> bool:
    """Export spans if an OTLP endpoint is set; whether it is."""
    if not environ.get(ENDPOINT_ENV):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise TracingUnavailable(f"{ENDPOINT_ENV} is set, but {error.name} is not installed (kembed[otel])") from None
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME", "kembed")}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # exported off the event loop
    use(provider)
    return True


def use(provider: Any) -> None:
    """Record spans with ``provider`` (an SDK ``TracerProvider``: the tests' holds an in-memory exporter)."""
    global _tracer
    _tracer = provider.get_tracer("kembed")


def record(name: str, carrier: Callable[[], Mapping[str, str]], result: EmbedResult) -> None:
    """An answered call's span and its stages' as children, ending now; ``carrier`` gives its
    headers or metadata, where the caller's trace context is (read only when tracing is on)."""
    if _tracer is None:
        return
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    timings, end = result.timings, time.time_ns()
    start_ns = end - int(timings.total_s * 1e9)
    span = _tracer.start_span(
        name,
        context=extract(carrier()),
        kind=trace.SpanKind.SERVER,
        start_time=start_ns,
        attributes={
            "kembed.request_id": request_log.request_id.get(),
            "kembed.items": len(result.token_counts),
            "kembed.tokens": int(result.token_counts.sum()),
        },
    )
    inside, at = trace.set_span_in_context(span), start_ns
    for stage, seconds in (
        ("tokenize", timings.tokenize_s),
        ("queue", timings.queue_s),
        ("compute", timings.inference_s),
    ):
        until = min(end, at + int(seconds * 1e9))  # compute sums batches run at once: kept within the call
        _tracer.start_span(stage, context=inside, start_time=at).end(end_time=until)
        at = until
    span.end(end_time=end)
