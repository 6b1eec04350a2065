"""The bulk lane: length-prefixed frames over TCP beside gRPC (authenticated and sealed unless the mesh runs
insecure), for the bytes gRPC moves too slowly.

grpc-python copies a message's bytes several times on each side (serialise, frame, deframe, parse, and once more
when a `bytes` field is read), and on loopback it moved about a third of what one socket moves. KV blocks are the
mesh's bulk traffic, so the store also answers layer-major reads and takes writes here (kvcache.proto, LaneFrame),
and decode takes prefill's KV pushes here (decode.proto, PushLaneFrame): the node writes straight from the blocks it
holds and the reader receives straight into the buffers the engine loads from (mesh.lane_io). Control stays on gRPC.

A frame is an 8-byte header (uint32 little-endian: the LaneFrame's length, the payload's length), the LaneFrame,
then the payload (sealed: each followed by its 16-byte tag). Sockets are non-blocking and driven by the event
loop, so an idle or waiting lane costs no thread; a large payload is moved by a worker thread (mesh.lane_io).
`LaneListener` serves each accepted connection with one task, one exchange at a time, and answers errors alike on
every lane. With an `ssl.SSLContext` a connection opens with a mutual TLS handshake and then carries frames sealed
with keys that handshake carried (mesh.lane_io): a peer without a certificate of the mesh's CA, or of a role the
lane does not take, is closed after the handshake with nothing sent. Every connection is bounded
(`LaneSettings`): connections per peer address and in all, a handshake deadline, an idle limit between exchanges,
a stall limit while a frame or an answer is under way and a deadline per exchange (an unfinished write is dropped
and its memory freed); a frame's bytes are buffered as they arrive, never at the size its header declares.
`LanePool` keeps idle connections per address; a connection whose exchange did not end cleanly is closed, never
reused, so a half-read answer cannot leak into the next one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import ssl
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry.trace import SpanKind

from mesh.config import LaneSettings
from mesh.lane_io import (
    Buffer,
    LaneError,
    handshake,
    is_idle_open,
    recv_frame_bytes,
    recv_raw_into,
    role_of,
    seal_as_client,
    seal_as_server,
    send_frame_bytes,
    server_context,
    stall_limit,
    wait_ready,
)
from mesh.lane_io import has_pending as has_pending  # the lane's users ask these of mesh.lane
from mesh.lane_io import recv_bytes as recv_bytes
from mesh.lane_io import recv_exactly_into as recv_exactly_into
from mesh.lane_io import send_all as send_all
from mesh.logging import get_logger
from mesh.pb import common_pb2, kvcache_pb2
from mesh.rpc import ServiceError
from mesh.tls import MeshCredentials, client_ssl_context, server_ssl_context
from mesh.tracing import context_of, span, traceparent

HEADER = struct.Struct("<II")
MAX_FRAME_BYTES = 16 * 2**20  # a LaneFrame (headers and requests: keys and layouts, never bulk bytes)
MAX_PAYLOAD_BYTES = 2**31
MAX_IDLE_PER_ADDRESS = 8
MAX_POOLED_IDLE_S = 20.0  # a pooled connection idle longer is closed, well before a lane's idle limit drops it
DRAIN_AFTER_ERROR_S = 10.0  # how long an answering side reads and drops what still comes after its error frame

M = TypeVar("M", bound=Message)
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}
log = get_logger(__name__)


async def recv_frame(sock: socket.socket, kind: type[M]) -> tuple[M, int]:
    """The next frame, a `kind` message, and its payload's length (the caller reads the payload). A frame past
    the lane's limits, or one that does not parse, is a LaneError; the frame's bytes are buffered as they come."""
    header = bytearray(HEADER.size)
    await recv_raw_into(sock, memoryview(header))
    frame_bytes, payload_bytes = HEADER.unpack(header)
    if frame_bytes > MAX_FRAME_BYTES or payload_bytes > MAX_PAYLOAD_BYTES:
        raise LaneError(f"frame of {frame_bytes} bytes with a payload of {payload_bytes}: past the lane's limits")
    encoded = await recv_frame_bytes(sock, bytes(header), frame_bytes, payload_bytes)
    try:
        return kind.FromString(encoded), payload_bytes
    except DecodeError as exc:
        raise LaneError(f"a frame that is not a {kind.DESCRIPTOR.name}: {exc}") from None


async def send_frame(sock: socket.socket, frame: Message, payload: Sequence[Buffer] = ()) -> None:
    """The frame, then the payload's pieces in order."""
    encoded = frame.SerializeToString()
    await send_frame_bytes(sock, HEADER.pack(len(encoded), sum(len(p) for p in payload)), encoded, payload)


async def read_answer(
    sock: socket.socket, request: kvcache_pb2.GetRequest
) -> AsyncIterator[tuple[kvcache_pb2.Block, int]]:
    """Send a read request, then yield each answer frame's Block and payload length until the end frame. The
    caller reads each payload before asking for the next frame; an answer that ends in an error is a LaneError."""
    await send_frame(sock, kvcache_pb2.LaneFrame(request=request, traceparent=traceparent()))
    while True:
        frame, payload_bytes = await recv_frame(sock, kvcache_pb2.LaneFrame)
        if frame.WhichOneof("kind") == "end":
            if frame.end.error:
                raise LaneError(frame.end.error)
            return
        yield frame.block, payload_bytes


def server_tls(credentials: MeshCredentials | None) -> ssl.SSLContext | None:
    """A listener's TLS context from this process's credentials (None under KVMESH_INSECURE=1: plain TCP)."""
    return None if credentials is None else server_ssl_context(credentials)


def client_tls(credentials: MeshCredentials | None) -> ssl.SSLContext | None:
    """A LanePool's TLS context from this process's credentials (None under KVMESH_INSECURE=1: plain TCP)."""
    return None if credentials is None else client_ssl_context(credentials)


def error_end(error: ServiceError) -> common_pb2.LaneEnd:
    """The end frame that reports `error`: its message, and the code the same error has on gRPC."""
    return common_pb2.LaneEnd(error=str(error), code=error.code.value[0])


def status_of(end: common_pb2.LaneEnd) -> grpc.StatusCode:
    return STATUS_BY_CODE.get(end.code, grpc.StatusCode.UNKNOWN)


async def send_error(sock: socket.socket, frame: Message) -> None:
    """Answer with an error frame, then read and drop whatever the peer still sends until it closes (up to
    DRAIN_AFTER_ERROR_S): closing with its bytes unread would reset the connection, and a reset can throw away
    the error frame before the peer has read it."""
    await send_frame(sock, frame)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    sink = bytearray(2**16)
    with contextlib.suppress(OSError, TimeoutError), stall_limit(None):
        async with asyncio.timeout(DRAIN_AFTER_ERROR_S):
            while True:
                try:
                    if not sock.recv_into(sink):
                        return
                except (BlockingIOError, InterruptedError):
                    await wait_ready(sock, writable=False)


async def connect(address: str, timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to the lane at host:port; with `ssl_context`, authenticated by mutual TLS and sealed."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    family, kind, protocol, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, protocol)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        async with asyncio.timeout(timeout_s):
            await loop.sock_connect(sock, sockaddr)
            if ssl_context is not None:
                tls = ssl_context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
                sock = tls
                await handshake(tls)
                sock = await seal_as_client(tls)
    except BaseException:
        sock.close()
        raise
    return sock


class BufferPool:
    """Receive buffers, reused. A fresh bytearray is zeroed and then faulted in page by page as bytes land, which
    for a large prefix cost more than moving it (256 MiB: 0.16 s, the wire 0.12 s). Buffers come back once their
    bytes are in the engine (which copies them); the idle ones are bounded by bytes, and a buffer given back makes
    room by dropping idle ones of other sizes (the sizes used lately win). `take` gives exactly the size asked
    (readers whose sizes repeat: one model's blocks); `take_at_least` rounds up to a power of two, so buffers of
    varied sizes (one per push) are reused too, at most twice the bytes asked (pages never written are never
    faulted in)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        if free:
            self.num_bytes -= size
            return free.pop()
        return bytearray(size)

    def take_at_least(self, size: int) -> bytearray:
        return self.take(1 << max(size - 1, 0).bit_length())

    def give(self, buffers: Sequence[bytearray]) -> None:
        for buffer in buffers:
            size = len(buffer)
            for other in sorted(self._free, reverse=True):  # the largest other size goes first
                if self.num_bytes + size <= self.max_bytes:
                    break
                if other != size:
                    self.num_bytes -= other * len(self._free.pop(other))
            if self.num_bytes + size <= self.max_bytes:
                self._free.setdefault(size, []).append(buffer)
                self.num_bytes += size


class LaneListener(abc.ABC, Generic[M]):
    """A lane's listening socket, for frames of type `frame_type` (a message with an `end` field, LaneEnd). Each
    connection is served by one task, one exchange at a time: the exchange's first frame goes to `answer`; a
    ServiceError it raises is answered with an end frame naming it (`send_error`), which ends the connection. A
    connection the peer closes between exchanges just ends; one that breaks mid-exchange is the peer's loss
    alone: logged, closed, nothing else disturbed.

    `ssl_context` (a server context of the mesh's CA; None: plain TCP, which logs a warning at start) makes it
    mutual TLS, and only peers whose certificate names one of `peer_roles` get an exchange. `limits` bound what a
    peer can hold: see LaneSettings. Only the accepting task and the connection tasks write the counts.

    While tracing is on, an exchange whose first frame carries a traceparent is answered in a SERVER span of that
    trace, named by `span_names` for the frame's kind as the gRPC method it stands in for."""

    # the first frame's kind -> the span's name (the gRPC method the exchange mirrors)
    span_names: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        frame_type: type[M],
        limits: LaneSettings | None = None,
        ssl_context: ssl.SSLContext | None = None,
        peer_roles: frozenset[str] = frozenset(),
    ) -> None:
        self.frame_type = frame_type
        self.limits = limits or LaneSettings()
        self.ssl_context = None if ssl_context is None else server_context(ssl_context)
        self.peer_roles = peer_roles
        self.num_refused = 0  # connections closed at accept: past a connection cap
        self.num_unauthorized = 0  # connections closed after the handshake failed or named a role not taken
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._num_by_peer: Counter[str] = Counter()

    @abc.abstractmethod
    async def answer(self, sock: socket.socket, frame: M, payload_bytes: int) -> None:
        """Answer the exchange `frame` begins (its payload still unread), or raise ServiceError."""

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); the port bound."""
        if self.ssl_context is None:
            log.warning("bulk lane without TLS: any peer that reaches its port can read and write KV", port=port)
        elif not self.limits.lane_encrypt:
            log.warning("bulk lane authenticates KV but does not encrypt it: it can be read on the wire", port=port)
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_forever())
        return int(listener.getsockname()[1])

    async def stop(self) -> None:
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._listener is not None:
            self._listener.close()

    def _can_accept(self, peer: str) -> bool:
        return (
            len(self._connections) < self.limits.lane_max_connections
            and self._num_by_peer[peer] < self.limits.lane_max_connections_per_peer
        )

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, address = await loop.sock_accept(self._listener)
            peer = str(address[0])
            if not self._can_accept(peer):
                sock.close()
                self.num_refused += 1
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._num_by_peer[peer] += 1
            task = asyncio.create_task(self._serve(sock, peer))
            self._connections.add(task)
            task.add_done_callback(lambda done, peer=peer: self._forget(done, peer))  # type: ignore[misc]

    def _forget(self, task: asyncio.Task[None], peer: str) -> None:
        self._connections.discard(task)
        self._num_by_peer[peer] -= 1
        if not self._num_by_peer[peer]:
            del self._num_by_peer[peer]

    async def _authenticate(self, sock: socket.socket, peer: str) -> socket.socket | None:
        """The connection, sealed, with a peer of a role this lane takes (mutual TLS); None (and closed) for any
        other."""
        if self.ssl_context is None:
            return sock
        tls = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            async with asyncio.timeout(self.limits.lane_handshake_timeout_s):
                await handshake(tls)
                role = role_of(tls.getpeercert())
                if role in self.peer_roles:
                    return await seal_as_server(tls, self.limits.lane_encrypt)
            reason = f"role {role!r} may not use this lane"
        except (LaneError, TimeoutError, OSError) as exc:
            reason = str(exc) or "no handshake in time"
        self.num_unauthorized += 1
        log.info("bulk lane peer refused", peer=peer, reason=reason)
        tls.close()
        return None

    async def _serve(self, raw: socket.socket, peer: str) -> None:
        limits = self.limits
        sock: socket.socket | None = None
        try:
            sock = await self._authenticate(raw, peer)
            while sock is not None:
                if not await self._wait_for_exchange(sock):
                    return
                with stall_limit(limits.lane_read_timeout_s):
                    async with asyncio.timeout(limits.lane_exchange_timeout_s):
                        try:
                            frame, payload_bytes = await recv_frame(sock, self.frame_type)
                        except LaneError:
                            return  # closed between exchanges: the normal end of a pooled connection
                        try:
                            with self._span(frame):
                                await self.answer(sock, frame, payload_bytes)
                        except ServiceError as error:
                            await send_error(sock, self.frame_type(end=error_end(error)))
                            return
        except TimeoutError:
            log.info("bulk lane exchange dropped: past its deadline", peer=peer)
        except (LaneError, OSError) as exc:  # the peer went away, stalled or broke the protocol: its loss only
            log.info("bulk lane connection dropped", peer=peer, error=str(exc))
        finally:
            (sock or raw).close()

    def _span(self, frame: M) -> contextlib.AbstractContextManager[object]:
        parent = context_of(getattr(frame, "traceparent", ""))
        if parent is None:
            return contextlib.nullcontext()
        name = self.span_names.get(str(frame.WhichOneof("kind")), type(self).__name__)
        return span(name, SpanKind.SERVER, {"rpc.system": "kvmesh.lane"}, parent)

    async def _wait_for_exchange(self, sock: socket.socket) -> bool:
        """Until the next exchange's first bytes (or the peer's close) are there; False past the idle limit."""
        try:
            with stall_limit(self.limits.lane_idle_timeout_s):
                await wait_ready(sock, writable=False)
        except LaneError:
            return False
        return True


class LanePool:
    """Connections to lanes, by address: each serves one exchange at a time, idle ones are kept for the next
    (up to MAX_POOLED_IDLE_S). With `ssl_context` (a client context of the mesh's CA and this process's
    certificate) every connection is mutual TLS."""

    def __init__(self, connect_timeout_s: float = 2.0, ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.ssl_context = ssl_context
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # address -> (connection, idle since)

    async def acquire(self, address: str) -> socket.socket:
        """An idle connection, else a new one (OSError, TimeoutError or LaneError when the lane cannot be reached
        or refuses the handshake)."""
        return self._take_idle(address) or await connect(address, self.connect_timeout_s, self.ssl_context)

    @contextlib.asynccontextmanager
    async def connection(self, address: str) -> AsyncIterator[socket.socket]:
        """A connection for one exchange; back to the pool only if the block exits normally."""
        async with self.holding(address, await self.acquire(address)) as sock:
            yield sock

    @contextlib.asynccontextmanager
    async def holding(self, address: str, sock: socket.socket) -> AsyncIterator[socket.socket]:
        """Use an acquired connection for one exchange; back to the pool only if the block exits normally."""
        try:
            yield sock
        except BaseException:
            sock.close()
            raise
        idle = self._idle.setdefault(address, [])
        if len(idle) < MAX_IDLE_PER_ADDRESS:
            idle.append((sock, time.monotonic()))
        else:
            sock.close()

    def _take_idle(self, address: str) -> socket.socket | None:
        idle = self._idle.get(address, [])
        while idle:
            sock, since = idle.pop()
            if time.monotonic() - since < MAX_POOLED_IDLE_S and is_idle_open(sock):
                return sock
            sock.close()
        return None

    def num_idle(self, address: str) -> int:
        return len(self._idle.get(address, []))

    def close(self) -> None:
        for idle in self._idle.values():
            for sock, _ in idle:
                sock.close()
        self._idle.clear()
