"""A small real OTLP trace receiver: the collector's TraceService over gRPC and POST /v1/traces (http/protobuf),
built from the opentelemetry-proto messages, keeping every span it is sent. `kvmesh bench serve --trace` exports
to one (so tracing's cost is measured with a real exporter at work), and the tracing tests assert on what it got."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {value: name.removeprefix("SPAN_KIND_") for name, value in trace_pb2.Span.SpanKind.items()}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # resource service.name
    instance: str  # resource service.instance.id
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    attributes: dict[str, Any]
    events: tuple[str, ...]
    is_error: bool
    duration_s: float = 0.0  # end minus start, by the clock of the process that made it
    start_s: float = 0.0  # the wall clock's, in seconds: comparable across the processes of one machine


def value_of(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in pairs}


class OTLPSink:
    """Listens on `host` (kvmesh.netns: the bridge's address): gRPC on `grpc_port`, HTTP on `http_port`.
    Thread-safe `spans()`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self.take), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{host}:0")
        self._http = http.server.ThreadingHTTPServer((host, 0), _handler_for(self.take))
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def exporter_env(self) -> dict[str, str]:
        """The standard settings that point a process's OTLP/gRPC exporter here."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{self.host}:{self.grpc_port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        }

    def __enter__(self) -> OTLPSink:
        self._grpc.start()
        self._http_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._grpc.stop(0)
        self._http.shutdown()
        self._http.server_close()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = list(_flatten(request))
        with self._lock:
            self._spans += received

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], trace_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition(self.spans(trace_id)):
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in self.spans(trace_id))
                raise TimeoutError(f"trace {trace_id} incomplete after {timeout_s:.0f} s; it has {names}")
            time.sleep(0.2)


def _flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ReceivedSpan(
                    service=resource.get("service.name", ""),
                    instance=resource.get("service.instance.id", ""),
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    name=span.name,
                    kind=KINDS[span.kind],
                    attributes=attributes_of(span.attributes),
                    events=tuple(event.name for event in span.events),
                    is_error=span.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                    duration_s=(span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                    start_s=span.start_time_unix_nano / 1e9,
                )


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, take: Callable[[trace_service_pb2.ExportTraceServiceRequest], None]) -> None:
        self.take = take

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any) -> Any:
        self.take(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _handler_for(take: Callable[[trace_service_pb2.ExportTraceServiceRequest], None]) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
