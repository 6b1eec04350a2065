"""OpenTelemetry tracing: one trace per request across every role, the W3C `traceparent` carried in gRPC metadata,
NATS headers and the bulk lanes' first frame of an exchange.

On only when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set: then each process
exports its spans over OTLP (OTEL_EXPORTER_OTLP_PROTOCOL: `grpc`, the default, or `http/protobuf`), batched as the
standard OTEL_BSP_* settings say, as resource `service.name` = kvmesh-<role>, `service.instance.id` = its worker
id. Off, nothing is imported from the SDK and every helper here is one flag check: no span is made, no header
is read or written.

Spans name what happened, never what was said: no prompt or output text, no API key, no key hash.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()
_INVALID = trace.INVALID_SPAN

# The OpenTelemetry GenAI semantic conventions, and kvmesh's own attributes beside them.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
WORKER_ID = "kvmesh.worker_id"
REQUEST_ID = "kvmesh.request_id"
TENANT = "kvmesh.tenant"
CACHED_TOKENS = "kvmesh.cached_tokens"  # + ".device" | ".store": the prompt tokens not computed, by tier
BYTES_MOVED = "kvmesh.kv.bytes"
SYSTEM = "kvmesh"


class _State:
    """The process's tracer; written once by `configure_tracing` (and `shutdown_tracing`), read everywhere."""

    tracer: trace.Tracer | None = None
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider, imported only when on
    worker_id = ""


def is_enabled() -> bool:
    return _State.tracer is not None


def endpoint_of(env: Mapping[str, str]) -> str:
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""


def protocol_of(env: Mapping[str, str]) -> str:
    """The OTLP protocol the standard settings ask for; anything but grpc and http/protobuf is refused."""
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: kvmesh exports traces over {' or '.join(PROTOCOLS)}"
        )
    return protocol


def configure_tracing(role: str, worker_id: str) -> bool:
    """Export this process's spans when an OTLP endpoint is set; True when tracing is on. The exporters read
    their own standard settings (endpoint, headers, timeout, insecure), the batch processor OTEL_BSP_*."""
    env = os.environ
    if not endpoint_of(env) or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    protocol = protocol_of(env)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    resource = Resource.create({"service.name": f"kvmesh-{role}", "service.instance.id": worker_id})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    shutdown_tracing()
    _State.provider = provider
    _State.tracer = provider.get_tracer("kvmesh")
    _State.worker_id = worker_id
    return True


def shutdown_tracing() -> None:
    """Export what is still queued (bounded by the exporter's timeout), then stop."""
    provider, _State.provider, _State.tracer = _State.provider, None, None
    if provider is not None:
        provider.shutdown()


# ---- spans ---------------------------------------------------------------------------------------------------


def current_span() -> Span:
    """The span work is in now (a no-op one when tracing is off or outside any request)."""
    return trace.get_current_span() if _State.tracer is not None else _INVALID


def context_from(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The caller's trace context from headers that may hold a `traceparent` (None: a root span; so is a
    malformed one, which the propagator ignores). Off: always None, the headers unread."""
    if _State.tracer is None or not carrier or TRACEPARENT not in carrier:
        return None
    return _PROPAGATOR.extract(carrier)


def context_of(traceparent: str) -> otel_context.Context | None:
    """`context_from` for a traceparent carried in a message field ("" when the sender traced nothing)."""
    return context_from({TRACEPARENT: traceparent} if traceparent else None)


@contextlib.contextmanager
def span(
    name: str,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    parent: otel_context.Context | None = None,
) -> Iterator[Span]:
    """A span, current inside; with `parent` (a caller's context) a child of that instead of the current one."""
    tracer = _State.tracer
    if tracer is None:
        yield _INVALID
        return
    with tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as started:
        started.set_attribute(WORKER_ID, _State.worker_id)
        yield started


def traceparent() -> str:
    """The current span as a W3C traceparent ("" when off or outside any span)."""
    if _State.tracer is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT, "")


def headers() -> dict[str, str]:
    """The trace context to send with a message (empty when off)."""
    value = traceparent()
    return {TRACEPARENT: value} if value else {}


def mark_error(target: Span, description: str) -> None:
    target.set_status(Status(StatusCode.ERROR, description))


# ---- gRPC servers --------------------------------------------------------------------------------------------


class ServerTracing(grpc.aio.ServerInterceptor):
    """Each call in a SERVER span named for its method, a child of the caller's `traceparent` (gRPC's
    semantic conventions: rpc.system, rpc.service, rpc.method); installed only while tracing is on.

    `is_public`: the gateway's API, where a call without a traceparent starts a trace. Between roles a call
    without one is background work (heartbeat-driven polls, the store's write-behind), not a request: untraced."""

    def __init__(self, is_public: bool) -> None:
        self.is_public = is_public

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _traced(handler, handler_call_details.method, self.is_public)  # type: ignore[attr-defined]


def _traced(handler: Any, method: str, is_public: bool) -> Any:
    name = method.lstrip("/")
    service, _, rpc_method = name.rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method}
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    inner = getattr(handler, kind)

    def server_span(context: grpc.aio.ServicerContext) -> contextlib.AbstractContextManager[Span]:
        caller = {key: value for key, value in context.invocation_metadata() or () if key == TRACEPARENT}
        if not caller and not is_public:
            return contextlib.nullcontext(_INVALID)
        return span(name, SpanKind.SERVER, attributes, context_from(caller))  # type: ignore[arg-type]

    if kind.endswith("_stream"):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with server_span(context):
                async for response in inner(request, context):
                    yield response

        return handler._replace(**{kind: streaming})

    async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with server_span(context):
            return await inner(request, context)

    return handler._replace(**{kind: single})


def server_interceptors(is_public: bool = False) -> list[grpc.aio.ServerInterceptor]:
    return [ServerTracing(is_public)] if is_enabled() else []


# ---- logs ----------------------------------------------------------------------------------------------------


def add_trace_ids(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the current span's trace_id and span_id on every line logged inside one."""
    if _State.tracer is None:
        return event_dict
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict["trace_id"] = trace.format_trace_id(context.trace_id)
        event_dict["span_id"] = trace.format_span_id(context.span_id)
    return event_dict
