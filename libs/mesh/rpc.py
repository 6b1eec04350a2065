"""gRPC helpers every role uses: servers and channels with the same options, deadlines, request ids,
and one mapping from exceptions to status codes.

Internal servers and channels speak mutual TLS with the process's certificate (mesh.tls), and every call to an
internal server passes the access table (mesh.access) first; without credentials (KVMESH_INSECURE=1) both are
plaintext and unchecked. The gateway's public API is the one server that does not ask for client certificates.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from mesh.access import allowed_callers
from mesh.logging import REQUEST_ID_KEY, current_request_id, get_logger
from mesh.metrics import GRPC_CALLS_DENIED
from mesh.tls import SERVER_NAME, MeshCredentials, peer_identity
from mesh.tracing import TRACEPARENT, server_interceptors, traceparent

log = get_logger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20  # KV chunks are split well below this; the margin is for odd layouts
KV_CHUNK_BYTES = 4 * 2**20  # target size of one KV chunk on the wire
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that went away and came back (a restarted container often keeps its address) is dialled again
    # within two seconds, not after gRPC's default backoff of up to two minutes; calls to it meanwhile fail fast
    # (UNAVAILABLE) and are routed elsewhere.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Servers accept the clients' keepalive pings (every 10 s, OPTIONS) but enforce a floor: a peer pinging an idle
# connection more often than every 5 s gets two strikes, then GOAWAY (gRPC's default floor is 5 minutes, which
# killed our own connections). Bounded per peer: streams per connection (past it a client queues its calls), the
# metadata of a call, connections idle 5 minutes (closed; a client redials on its next call), and calls in flight
# in all (MAX_CONCURRENT_RPCS: past it RESOURCE_EXHAUSTED). Messages are capped by MAX_MESSAGE_BYTES as they
# arrive (gRPC refuses a larger one from its length prefix, before reading it). A port in use is an error at bind:
# gRPC sets SO_REUSEPORT by default on Linux, so a second server on a taken port would share it with the first,
# the kernel handing each new connection to either process (another mesh's worker, or a stale one); only the
# gateway's replicas share their port, and they ask for it (create_public_server(reuse_port=True)).
MAX_CONCURRENT_STREAMS = 4096  # per connection: above any decode worker's batch, so a gateway never waits on it
MAX_CONCURRENT_RPCS = 16384  # per server, every connection together
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    ("grpc.max_metadata_size", 16 * 1024),
    ("grpc.max_connection_idle_ms", 300_000),
    ("grpc.so_reuseport", 0),
]

# Deadlines (seconds) for calls between roles.
ROUTE_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S = 600.0  # a long prompt on a busy CPU worker takes a while
KVCACHE_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 2.0

# Trailing metadata of a failed call that names the worker at fault (prefill sets it when its push to a
# decode worker fails), so the caller can route around that worker and retry elsewhere.
FAILED_WORKER_KEY = "kvmesh-failed-worker"
# Initial metadata decode sends on Decode.PushKV once it has reserved the blocks, so prefill learns of a refusal
# (RESOURCE_EXHAUSTED) from the status itself, before it streams chunks into a call that is already over.
KV_RESERVED_KEY = "kvmesh-kv-reserved"


def create_server(credentials: MeshCredentials | None) -> grpc.aio.Server:
    """An internal server: with credentials, every call is authorized by the caller's role (mesh.access)."""
    interceptors = [*server_interceptors(), *([Authorization()] if credentials is not None else [])]
    return grpc.aio.server(
        options=SERVER_OPTIONS, interceptors=interceptors, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS
    )


def create_public_server(reuse_port: bool = False) -> grpc.aio.Server:
    """The gateway's API for clients: API keys authenticate them, not certificates (bind it with credentials=None).
    reuse_port: SO_REUSEPORT, for gateway replicas sharing the port."""
    return grpc.aio.server(
        options=[(key, 1 if key == "grpc.so_reuseport" else value) for key, value in SERVER_OPTIONS]
        if reuse_port
        else SERVER_OPTIONS,  # gRPC takes a key's first value: replaced, not appended
        interceptors=server_interceptors(is_public=True),
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )


def bind(server: grpc.aio.Server, host: str, port: int, credentials: MeshCredentials | None) -> int:
    """Bind to host:port (0: any free port), mutual TLS with credentials, else plaintext; returns the bound port."""
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        server_credentials = grpc.ssl_server_credentials(
            [(credentials.key_pem, credentials.cert_pem)],
            root_certificates=credentials.ca_pem,
            require_client_auth=True,
        )
        bound = server.add_secure_port(address, server_credentials)
    if bound == 0:
        raise OSError(f"cannot bind a gRPC server to {address}")
    return bound


class Channels:
    """One channel per address, reused by every call to it; mutual TLS as this process with credentials."""

    def __init__(self, credentials: MeshCredentials | None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._credentials = None
        if credentials is not None:
            self._credentials = grpc.ssl_channel_credentials(
                credentials.ca_pem, credentials.key_pem, credentials.cert_pem
            )

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=OPTIONS)
            else:
                options = [*OPTIONS, ("grpc.ssl_target_name_override", SERVER_NAME)]
                channel = grpc.aio.secure_channel(address, self._credentials, options=options)
            self._channels[address] = channel
        return channel

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class Authorization(grpc.aio.ServerInterceptor):
    """Runs each call's handler only for the roles mesh.access allows; anyone else gets PERMISSION_DENIED.

    The caller's role is in the auth context, which only the handler's context carries, so the check wraps the
    handler (keeping its kind: a coroutine or an async generator, as grpc.aio dispatches on it)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _guarded(handler, handler_call_details.method)  # type: ignore[attr-defined]


def _guarded(handler: Any, method: str) -> Any:
    allowed = allowed_callers(method)

    async def check(context: grpc.aio.ServicerContext) -> None:
        identity = peer_identity(context.auth_context())
        if identity is None or identity.role not in allowed:
            role = identity.role if identity is not None else "(no kvmesh identity)"
            log.warning("call refused", method=method, caller=identity.uri if identity else role)
            GRPC_CALLS_DENIED.labels(method, identity.role if identity else "none").inc()
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: a {role} may not call it (allowed: {', '.join(sorted(allowed)) or 'nobody'})",
            )

    kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
    inner = getattr(handler, kind)
    parse = _parsed_stream if kind.startswith("stream_") else _parsed
    tolerant = {"request_deserializer": _tolerant(handler.request_deserializer)}
    if inspect.isasyncgenfunction(inner):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(context)
            async for response in inner(await parse(request, context, method), context):
                yield response

        return handler._replace(**{kind: streaming}, **tolerant)
    assert inspect.iscoroutinefunction(inner), f"{method}: the mesh's handlers are async"

    async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        return await inner(await parse(request, context, method), context)

    return handler._replace(**{kind: single}, **tolerant)


class _Malformed:
    """A request message whose bytes did not parse. grpc.aio parses before the handler runs and answers a parse
    error with UNKNOWN and a logged traceback, before the access check: so the deserializer hands this on
    instead, and the handler's wrapper answers INVALID_ARGUMENT once the caller is known to be allowed."""

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            return _Malformed(str(error))

    return deserialize


async def _refuse_malformed(context: grpc.aio.ServicerContext, method: str, request: _Malformed) -> None:
    log.warning("malformed request refused", method=method)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {request.error}")


async def _parsed(request: Any, context: grpc.aio.ServicerContext, method: str) -> Any:
    if isinstance(request, _Malformed):
        await _refuse_malformed(context, method, request)
    return request


async def _parsed_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str) -> Any:
    async def messages() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Malformed):
                await _refuse_malformed(context, method, request)
            yield request

    return messages()


def metadata(request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """A call's metadata: the request id, and the current span's traceparent while tracing is on."""
    request_id = request_id or current_request_id()
    pairs = ((REQUEST_ID_KEY, request_id),) if request_id else ()
    parent = traceparent()
    return (*pairs, (TRACEPARENT, parent)) if parent else pairs


def request_id_of(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return None


class ServiceError(Exception):
    """An error a handler reports to its caller with a status code (the one place codes are chosen).

    `trailing_metadata` travels with the status, e.g. FAILED_WORKER_KEY naming the worker to route around.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.trailing_metadata = trailing_metadata


class UnknownModelError(LookupError):
    """A request named a model this worker does not serve (each role's status mapping makes it NOT_FOUND)."""


@contextlib.contextmanager
def status_on_error() -> Iterator[None]:
    """Inside a handler: map library exceptions to status codes (raised as ServiceError)."""
    try:
        yield
    except ServiceError:
        raise
    except (ValueError, KeyError) as exc:  # PromptError, SamplingParamsError, KVLayoutError, unknown ids
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc).strip("'\"")) from exc


async def abort_with(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    await context.abort(error.code, str(error), trailing_metadata=error.trailing_metadata)
