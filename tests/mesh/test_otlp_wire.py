"""mesh.otlp_wire writes, byte for byte, the request the OTLP exporter's own encoder writes, for spans of every shape
the SDK makes: each attribute value type, events, error statuses, remote and local parents, trace state, dropped
attributes and events, several resources and scopes."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from mesh import otlp_wire, tracing

VALUES = {
    "text": "prefill-0",
    "empty": "",
    "unicode": "d\u00e9code \u2713",
    "yes": True,
    "no": False,
    "zero": 0,
    "one": 1,
    "negative": -5,
    "large": 2**62 + 7,
    "ratio": 0.25,
    "reasons": ["length", "stop"],
    "counts": [1, 2, 300],
    "none_yet": [],
}


def finished_spans(resource: Resource, limits: SpanLimits | None = None) -> tuple[ReadableSpan, ...]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource, span_limits=limits or SpanLimits())
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("kvmesh", "1.2.3", schema_url="https://opentelemetry.io/schemas/1.21.0")
    state = TraceState([("vendor", "v1"), ("other", "x")])
    remote = SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, True, TraceFlags(1), state)
    parent = trace.set_span_in_context(NonRecordingSpan(remote))
    with tracer.start_as_current_span("chat m", parent, SpanKind.SERVER, attributes=VALUES) as root:
        root.add_event("first token", {"kvmesh.num_tokens": 1})
        root.add_event("bare")
        for kind in (SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.PRODUCER, SpanKind.CONSUMER):
            with tracer.start_as_current_span(f"child {kind.name}", kind=kind, attributes={"kvmesh.worker_id": "w"}):
                pass
        with tracer.start_as_current_span("failed", record_exception=False) as failed:
            failed.set_status(Status(StatusCode.ERROR, "ValueError: no"))
        with tracer.start_as_current_span("fine") as fine:
            fine.set_status(Status(StatusCode.OK))
    with tracer.start_as_current_span("a root of its own", attributes={"yes": True, "one": 1}):
        pass
    provider.get_tracer("other-scope").start_span("").end()  # no version, no schema, no name
    return memory.get_finished_spans()


def test_the_request_is_the_exporters_byte_for_byte() -> None:
    spans = finished_spans(Resource.create({"service.name": "kvmesh-prefill", "service.instance.id": "prefill-0"}))
    assert len(spans) == 9
    encoded = otlp_wire.encode_request(spans)
    assert encoded == encode_spans(spans).SerializeToString()
    assert ExportTraceServiceRequest.FromString(encoded) == encode_spans(spans)
    assert otlp_wire.encode_request(spans) == encoded  # again, from the cache of repeated attributes


def test_several_resources_dropped_counts_and_a_schema_url() -> None:
    limits = SpanLimits(max_span_attributes=3, max_events=1)
    spans = finished_spans(Resource({"service.name": "kvmesh-decode"}, "https://example.com/schema"), limits)
    spans += finished_spans(Resource.create({"service.name": "kvmesh-gateway"}))
    assert spans[-1].dropped_attributes == 0 and any(s.dropped_attributes > 0 for s in spans)
    assert any(s.dropped_events > 0 for s in spans)
    assert otlp_wire.encode_request(spans) == encode_spans(spans).SerializeToString()


def test_equal_but_differently_typed_values_are_encoded_apart() -> None:
    # True == 1 == 1.0 and hash alike: a cache keyed by value alone would send one as another
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for value in (True, 1, 1.0, "1"):
        provider.get_tracer("t").start_span("s", attributes={"flag": value}).end()
    spans = memory.get_finished_spans()
    encoded = otlp_wire.encode_request(spans)
    assert encoded == encode_spans(spans).SerializeToString()
    message = ExportTraceServiceRequest.FromString(encoded)
    kinds = [s.attributes[0].value.WhichOneof("value") for s in message.resource_spans[0].scope_spans[0].spans]
    assert kinds == ["bool_value", "int_value", "double_value", "string_value"]


def test_a_span_with_links_is_left_to_the_exporters_encoder() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    linked = SpanContext(1, 2, is_remote=True)
    provider.get_tracer("t").start_span("linked", links=[Link(linked)]).end()
    assert otlp_wire.encode_request(memory.get_finished_spans()) is None


def test_a_value_protobuf_cannot_hold_is_left_to_the_exporters_encoder_which_drops_it() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("t").start_span("s", attributes={"huge": 2**64, "kept": 1}).end()
    spans = memory.get_finished_spans()
    with pytest.raises(ValueError, match="out of an int64's range"):
        otlp_wire.encode_request(spans)
    request = tracing._wire_encoded()._translate_data(spans)  # the exporter kvmesh's OTLP/gRPC export uses
    assert [kv.key for kv in request.resource_spans[0].scope_spans[0].spans[0].attributes] == ["kept"]


def test_the_cache_is_bounded() -> None:
    resource = Resource.create({})
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for index in range(otlp_wire.MAX_CACHED + 10):
        provider.get_tracer("t").start_span("s", attributes={"kvmesh.request_id": f"r-{index}"}).end()
    spans = memory.get_finished_spans()
    assert otlp_wire.encode_request(spans) == encode_spans(spans).SerializeToString()
    assert len(otlp_wire._ENCODED) <= otlp_wire.MAX_CACHED
