"""mesh.tracing against a real OTLP receiver (gRPC and http/protobuf): a call's span joins its caller's trace
through gRPC metadata, resources name the role and worker, log lines carry the ids, and off means no spans."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvmesh.bench.otlp_sink import OTLPSink
from mesh import rpc, tracing
from mesh.logging import configure_logging, current_request_id, get_logger

ECHO = "/kvmesh.v1.Test/Echo"


@pytest.fixture
def receiver():
    with OTLPSink() as running:
        yield running


@pytest.fixture(autouse=True)
def off_after():
    logging_config = structlog.get_config()
    yield
    tracing.shutdown_tracing()
    structlog.configure(**logging_config)


async def call_echo(payload: bytes, public: bool = False) -> bytes:
    """A real server from rpc.create_server (insecure; or the public one), one unary call to it with rpc.metadata."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        get_logger("test").info("inside the call")
        return request

    server = rpc.create_public_server() if public else rpc.create_server(None)
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvmesh.v1.Test", {"Echo": handler}),))
    port = rpc.bind(server, "127.0.0.1", 0, None)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await channel.unary_unary(ECHO)(payload, metadata=rpc.metadata("req-1"), timeout=10)
    finally:
        await server.stop(None)


def test_off_without_an_endpoint_no_span_no_header(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.configure_tracing("prefill", "prefill-0") is False
    assert not tracing.is_enabled()
    with tracing.span("work") as span:
        assert not span.is_recording()
        assert tracing.traceparent() == ""
        assert tracing.headers() == {}
        assert rpc.metadata("req-1") == (("x-request-id", "req-1"),)
    assert tracing.server_interceptors() == []


def test_an_unknown_protocol_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        tracing.configure_tracing("prefill", "prefill-0")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_a_call_joins_its_callers_trace_over_either_protocol(monkeypatch, receiver, protocol):
    port = receiver.grpc_port if protocol == "grpc" else receiver.http_port
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    lines = io.StringIO()
    monkeypatch.setattr(sys, "stderr", lines)
    configure_logging("info", "json")
    assert tracing.configure_tracing("prefill", "prefill-7") is True
    with tracing.span("caller", attributes={tracing.GEN_AI_MODEL: "m"}) as caller:
        assert await call_echo(b"hello") == b"hello"
        trace_id = format(caller.get_span_context().trace_id, "032x")
        caller_id = format(caller.get_span_context().span_id, "016x")
    tracing.shutdown_tracing()  # flushes

    spans = {s.name: s for s in receiver.spans(trace_id)}
    assert set(spans) == {"caller", "kvmesh.v1.Test/Echo"}
    server = spans["kvmesh.v1.Test/Echo"]
    assert (server.parent_id, server.kind) == (caller_id, "SERVER")
    assert server.attributes["rpc.system"] == "grpc"
    assert (server.attributes["rpc.service"], server.attributes["rpc.method"]) == ("kvmesh.v1.Test", "Echo")
    assert {(s.service, s.instance) for s in spans.values()} == {("kvmesh-prefill", "prefill-7")}
    assert spans["caller"].attributes == {tracing.WORKER_ID: "prefill-7", tracing.GEN_AI_MODEL: "m"}
    logged = [json.loads(line) for line in lines.getvalue().splitlines() if line.startswith("{")]
    inside = next(line for line in logged if line["event"] == "inside the call")
    assert (inside["trace_id"], inside["span_id"]) == (trace_id, server.span_id)


async def test_between_roles_only_calls_inside_a_trace_are_traced_the_public_api_always(monkeypatch, receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    assert tracing.configure_tracing("gateway", "gateway-0")
    assert await call_echo(b"background") == b"background"  # no traceparent: a heartbeat-like poll, untraced
    assert await call_echo(b"client", public=True) == b"client"  # a client without one: a new trace
    tracing.shutdown_tracing()
    (root,) = receiver.spans()
    assert (root.name, root.kind, root.parent_id) == ("kvmesh.v1.Test/Echo", "SERVER", "")


class Invocation:
    """What the server hook reads of a call's context: its metadata (a caller's traceparent)."""

    def __init__(self, traceparent: str) -> None:
        self.metadata = ((tracing.TRACEPARENT, traceparent),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


async def test_a_stream_closed_from_another_task_ends_its_span_inside_its_cleanup_without_a_detach_error(
    monkeypatch, receiver, caplog
):
    """gRPC may close a server stream's generator from a task other than the one that ran it (a call that ends
    early). The span is current only while the handler runs, never across a yield, so closing it elsewhere
    detaches nothing foreign (OpenTelemetry logs "Failed to detach context" otherwise), and the handler's cleanup
    still runs inside the span."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    assert tracing.configure_tracing("decode", "decode-0")

    async def tokens(request: bytes, context: object) -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield b"%d" % i
        finally:
            trace.get_current_span().set_attribute("cleaned_up", True)

    handler = tracing._traced(grpc.unary_stream_rpc_method_handler(tokens), "/kvmesh.v1.Test/Tokens", False)
    with tracing.span("caller") as caller:
        trace_id = format(caller.get_span_context().trace_id, "032x")
        stream = handler.unary_stream(b"", Invocation(tracing.traceparent()))
    assert [await anext(stream) for _ in range(3)] == [b"0", b"1", b"2"]
    await asyncio.create_task(stream.aclose())  # another task: another Context
    tracing.shutdown_tracing()
    spans = {s.name: s for s in receiver.spans(trace_id)}
    assert spans["kvmesh.v1.Test/Tokens"].attributes["cleaned_up"] is True
    assert spans["kvmesh.v1.Test/Tokens"].parent_id == spans["caller"].span_id
    assert [r.getMessage() for r in caplog.records if "detach" in r.getMessage()] == []


async def test_a_callers_traceparent_is_honoured_and_errors_mark_the_span(monkeypatch, receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    assert tracing.configure_tracing("gateway", "gateway-0")
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.span("root", parent=tracing.context_of(client)), pytest.raises(RuntimeError), tracing.span("failing"):
        raise RuntimeError("boom")
    tracing.shutdown_tracing()
    spans = {s.name: s for s in receiver.spans("0af7651916cd43dd8448eb211c80319c")}
    assert spans["root"].parent_id == "b7ad6b7169203331"
    assert spans["failing"].parent_id == spans["root"].span_id
    assert spans["failing"].is_error and not spans["root"].is_error


async def test_a_malformed_traceparent_starts_a_new_trace(monkeypatch, receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    assert tracing.configure_tracing("gateway", "gateway-0")
    with tracing.span("root", parent=tracing.context_from({"traceparent": "00-not-a-trace-01"})) as root:
        trace_id = format(root.get_span_context().trace_id, "032x")
    tracing.shutdown_tracing()
    (received,) = receiver.spans(trace_id)
    assert (received.name, received.parent_id) == ("root", "")


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TRACE}-{PARENT}-01",
        f"00-{TRACE}-{PARENT}-00",
        f" \t00-{TRACE}-{PARENT}-01 ",
        f"cc-{TRACE}-{PARENT}-01-what-a-later-version-adds",
        f"00-{TRACE}-{PARENT}-01-more",  # version 00 has exactly four fields
        f"ff-{TRACE}-{PARENT}-01",
        f"00-{TRACE.upper()}-{PARENT}-01",
        f"00-{'0' * 32}-{PARENT}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE[:-1]}+-{PARENT}-01",
        f"00-{TRACE[:-1]}_-{PARENT}-01",
        f"00-{TRACE}-{PARENT}-1",
        f"00-{TRACE}-{PARENT}-01x",
        "00-not-a-trace-01",
        "",
        f"cc-{TRACE}-{PARENT}-01-{'x' * 512}",
    ],
)
def test_a_traceparent_is_read_as_the_sdks_propagator_reads_it(monkeypatch, receiver, value):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    assert tracing.configure_tracing("gateway", "gateway-0")
    expected = trace.get_current_span(TraceContextTextMapPropagator().extract({"traceparent": value}))
    got = trace.get_current_span(tracing.context_from({"traceparent": value}))
    assert got.get_span_context() == expected.get_span_context()
    assert got.get_span_context().trace_flags == expected.get_span_context().trace_flags


def test_the_traceparent_sent_is_the_propagators(monkeypatch, receiver):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    assert tracing.configure_tracing("gateway", "gateway-0")
    with tracing.span("root", parent=tracing.context_of(f"00-{TRACE}-{PARENT}-01")) as root:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        span_id = format(root.get_span_context().span_id, "016x")
        assert tracing.traceparent() == carrier["traceparent"] == f"00-{TRACE}-{span_id}-01"
    assert tracing.traceparent() == ""


async def test_a_message_sent_in_a_trace_is_handled_in_a_consumer_span_and_an_ignored_one_in_none(
    monkeypatch, receiver, tmp_path
):
    """NATS headers carry the traceparent; a subscriber's `ignore` (a balancer hearing its own assignment) drops the
    message before the CONSUMER span and the handler; an untraced subscription (bookkeeping) handles it in none,
    with the request id still bound."""
    from kvmesh.nats_server import EmbeddedNats
    from mesh.bus import Bus
    from mesh.pb import balancer_pb2

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.grpc_port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    assert tracing.configure_tracing("balancer", "balancer-0") is True
    heard: list[str] = []
    kept: list[tuple[str, str, str]] = []

    async def on_assignment(message: balancer_pb2.Assignment, subject: str) -> None:
        heard.append(message.balancer_id)

    async def on_bookkeeping(message: balancer_pb2.Assignment, subject: str) -> None:
        kept.append((message.balancer_id, current_request_id(), tracing.traceparent()))

    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        bus = await Bus.connect(nats.url, "test-tracing")
        try:
            await bus.subscribe(
                "test.assign", balancer_pb2.Assignment, on_assignment, ignore=lambda m: m.balancer_id == "balancer-0"
            )
            await bus.subscribe("test.finished", balancer_pb2.Assignment, on_bookkeeping, is_traced=False)
            with tracing.span("route") as route:
                await bus.publish("test.assign", balancer_pb2.Assignment(balancer_id="balancer-0"), "r-1")
                await bus.publish("test.assign", balancer_pb2.Assignment(balancer_id="balancer-1"), "r-1")
                await bus.publish("test.finished", balancer_pb2.Assignment(balancer_id="balancer-2"), "r-2")
                trace_id = format(route.get_span_context().trace_id, "032x")
                route_id = format(route.get_span_context().span_id, "016x")
            await bus.flush()
            for _ in range(100):
                if heard and kept:
                    break
                await asyncio.sleep(0.02)
        finally:
            await bus.close()
    tracing.shutdown_tracing()  # flushes

    assert heard == ["balancer-1"]
    assert kept == [("balancer-2", "r-2", "")]  # handled, under its request id, in no span
    spans = receiver.spans(trace_id)
    assert sorted(s.name for s in spans) == ["process test.assign", "route"]
    (consumer,) = (s for s in spans if s.name == "process test.assign")
    assert (consumer.parent_id, consumer.kind) == (route_id, "CONSUMER")
    assert consumer.attributes["messaging.system"] == "nats"
