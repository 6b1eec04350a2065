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

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()
_INVALID = trace.INVALID_SPAN
_HEX_DIGITS = frozenset("0123456789abcdef")
_EMPTY = otel_context.Context()  # immutable: a parent with no span in it starts a trace

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
    worker_attributes: Mapping[str, str] = {}  # {WORKER_ID: worker_id}, for spans started without attributes


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
    resource = _hashed_once(Resource.create({"service.name": f"kvmesh-{role}", "service.instance.id": worker_id}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    shutdown_tracing()
    _State.provider = provider
    _State.tracer = provider.get_tracer("kvmesh")
    _State.worker_id = worker_id
    _State.worker_attributes = {WORKER_ID: worker_id}
    return True


def _hashed_once(resource: Any) -> Any:
    """The resource, its hash computed once: the OTLP encoder groups every exported span by its resource, and
    the SDK's Resource hashes by dumping its attributes to JSON each time (a tenth of the export's CPU)."""
    from opentelemetry.sdk.resources import Resource

    class HashedOnce(Resource):
        def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    return HashedOnce(resource.attributes, resource.schema_url)


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
    """The caller's trace context from headers that may hold a `traceparent` (None: a root span; a malformed
    one is ignored, so an empty context: a root span too). Off: always None, the headers unread."""
    if _State.tracer is None or not carrier or TRACEPARENT not in carrier:
        return None
    if "tracestate" in carrier:  # a client's vendor state: the propagator keeps it
        return _PROPAGATOR.extract(carrier)
    remote = _parse(carrier[TRACEPARENT])
    return trace.set_span_in_context(trace.NonRecordingSpan(remote), _EMPTY) if remote is not None else _EMPTY


def _parse(value: str) -> SpanContext | None:
    """A W3C traceparent as the SDK's propagator reads it (the version's fields; a later version may append
    more), without its regular expression and context copies: this runs at every hop of every request."""
    if len(value) > _PROPAGATOR._TRACEPARENT_MAXIMUM_LENGTH:
        return None
    parts = value.strip(" \t").split("-")
    if len(parts) < 4 or (len(parts) > 4 and parts[0] == "00"):
        return None
    version, trace_id, span_id, flags = parts[:4]
    if (len(version), len(trace_id), len(span_id), len(flags)) != (2, 32, 16, 2) or version == "ff":
        return None
    if not _HEX_DIGITS.issuperset(version + trace_id + span_id + flags):  # lower-case hex, as the W3C's
        return None
    context = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    return context if context.is_valid else None


def context_of(traceparent: str) -> otel_context.Context | None:
    """`context_from` for a traceparent carried in a message field ("" when the sender traced nothing)."""
    return context_from({TRACEPARENT: traceparent} if traceparent else None)


class span:  # lower case: used as the function it replaced, `with span(...) as s`
    """A span, current inside; with `parent` (a caller's context) a child of that instead of the current one.
    An exception leaving it is recorded on it and marks it an error (as the SDK's `start_as_current_span`).

    A class, not generator context managers nested three deep as the SDK's is: every hop of every request
    opens several, and the worker id goes in with the attributes it starts with, not as a second call."""

    __slots__ = ("_context", "_span", "_token")

    def __init__(
        self,
        name: str,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        parent: otel_context.Context | None = None,
    ) -> None:
        tracer = _State.tracer
        self._token: object = None
        if tracer is None:
            self._span: Span = _INVALID
            self._context: otel_context.Context | None = None
            return
        with_worker = {**attributes, WORKER_ID: _State.worker_id} if attributes else _State.worker_attributes
        self._span = tracer.start_span(name, context=parent, kind=kind, attributes=with_worker)
        # made once (a Context is immutable): a streaming call attaches it again at every step
        self._context = trace.set_span_in_context(self._span)

    def __enter__(self) -> Span:
        if self._context is not None:
            self._token = otel_context.attach(self._context)
        return self._span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: Any) -> None:
        if self._context is None:
            return
        otel_context.detach(self._token)  # type: ignore[arg-type]
        self.finish(error)

    def current(self) -> _Current:
        """The span current for one step only, attached and detached in the same task: for an async generator,
        which may be resumed or closed from another task's context, where a token attached across its yields
        could not be detached."""
        return _Current(self._span, self._context)

    def finish(self, error: BaseException | None = None) -> None:
        """End the span; an Exception (not GeneratorExit, CancelledError and the like, as the SDK) is recorded on
        it and marks it an error."""
        if self._span is _INVALID:
            return
        if isinstance(error, Exception) and self._span.is_recording():
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self._span.end()


class _Current:
    """`span.current()`: a class, not a generator context manager, as it is entered at every step of a stream."""

    __slots__ = ("_context", "_span", "_token")

    def __init__(self, target: Span, context: otel_context.Context | None) -> None:
        self._span = target
        self._context = context
        self._token: object = None

    def __enter__(self) -> Span:
        if self._context is not None:
            self._token = otel_context.attach(self._context)
        return self._span

    def __exit__(self, *_: object) -> None:
        if self._context is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]


def traceparent() -> str:
    """The current span as a W3C traceparent ("" when off or outside any span), formatted as the propagator
    does, without its carrier."""
    if _State.tracer is None:
        return ""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


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
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (its handler, that handler traced)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method  # type: ignore[attr-defined]
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:  # a server's handlers are made once: wrapped once
            return cached[1]
        traced = _traced(handler, method, self.is_public)
        self._wrapped[method] = (handler, traced)
        return traced


def _traced(handler: Any, method: str, is_public: bool) -> Any:
    name = method.lstrip("/")
    service, _, rpc_method = name.rpartition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method}
    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    inner = getattr(handler, kind)

    def server_span(context: grpc.aio.ServicerContext) -> span:
        caller = {key: value for key, value in context.invocation_metadata() or () if key == TRACEPARENT}
        if not caller and not is_public:
            return _NO_SPAN
        return span(name, SpanKind.SERVER, attributes, context_from(caller))  # type: ignore[arg-type]

    if kind.endswith("_stream"):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # the span is current only while the handler runs (each step, and its cleanup), never across a
            # yield: a cancelled call's generator is closed from another task's context
            scope = server_span(context)
            responses = inner(request, context)
            error: BaseException | None = None
            try:
                while True:
                    with scope.current():
                        try:
                            response = await anext(responses)
                        except StopAsyncIteration:
                            break
                    yield response
            except BaseException as failed:
                error = failed
                raise
            finally:  # a cancelled call: the handler's own cleanup (its last attributes) inside the span
                with scope.current():
                    await responses.aclose()
                scope.finish(error)

        return handler._replace(**{kind: streaming})

    async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with server_span(context):
            return await inner(request, context)

    return handler._replace(**{kind: single})


_NO_SPAN = span.__new__(span)  # no caller's trace on an internal call: nothing is recorded
_NO_SPAN._span = _INVALID
_NO_SPAN._context = None
_NO_SPAN._token = None


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
