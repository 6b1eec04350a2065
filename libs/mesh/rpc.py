"""gRPC helpers every role uses: servers and channels with the same options, deadlines, request ids,
and one mapping from exceptions to status codes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import grpc.aio

from mesh.logging import REQUEST_ID_KEY, current_request_id

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
# Servers must accept the clients' keepalive pings (by default they answer pings more often than every 5 minutes
# on an idle connection with GOAWAY "too_many_pings", which kills the connection and its calls).
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),  # never close a connection for pinging
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


def create_server() -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind to host:port (0: any free port); returns the bound port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind a gRPC server to {host}:{port}")
    return bound


class Channels:
    """One channel per address, reused by every call to it."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=OPTIONS)
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


def metadata(request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    request_id = request_id or current_request_id()
    return ((REQUEST_ID_KEY, request_id),) if request_id else ()


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
