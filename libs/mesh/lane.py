"""The bulk lane: length-prefixed frames over a plain TCP socket beside gRPC, for the bytes gRPC moves too slowly.

grpc-python copies a message's bytes several times on each side (serialise, frame, deframe, parse, and once more
when a `bytes` field is read), and on loopback it moved about a third of what one socket moves. KV blocks are the
mesh's bulk traffic, so the store also answers layer-major reads and takes writes here (kvcache.proto, LaneFrame),
and decode takes prefill's KV pushes here (decode.proto, PushLaneFrame): the node writes straight from the blocks it
holds (gather writes: `sendmsg` of the slices, no joins) and the reader receives straight into the buffers the
engine loads from (scatter reads: `recvmsg_into` the blocks' slices). Control stays on gRPC.

A frame is an 8-byte header (uint32 little-endian: the LaneFrame's length, the payload's length), the LaneFrame,
then the payload. Sockets are non-blocking and driven by the event loop (a call goes straight to the socket and
waits for readiness only when it would block), so one lane costs no thread. `LaneListener` serves each accepted
connection with one task, one exchange at a time, and answers errors alike on every lane. `LanePool` keeps idle
connections per address; a connection whose exchange did not end cleanly is closed, never reused, so a half-read
answer cannot leak into the next one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from typing import Generic, TypeVar

import grpc
from google.protobuf.message import Message

from mesh.logging import get_logger
from mesh.pb import common_pb2, kvcache_pb2
from mesh.rpc import ServiceError

HEADER = struct.Struct("<II")
MAX_FRAME_BYTES = 16 * 2**20  # a LaneFrame (headers and requests: keys and layouts, never bulk bytes)
MAX_PAYLOAD_BYTES = 2**31
IOV_MAX = 512  # pieces per sendmsg / recvmsg_into (the kernel allows 1024)
MAX_IDLE_PER_ADDRESS = 8
DRAIN_AFTER_ERROR_S = 10.0  # how long an answering side reads and drops what still comes after its error frame

Buffer = bytes | bytearray | memoryview
M = TypeVar("M", bound=Message)
STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}
log = get_logger(__name__)


class LaneError(ConnectionError):
    """The peer closed the connection, sent a frame that breaks the protocol, or answered with an error."""


async def _ready(sock: socket.socket, writable: bool) -> None:
    """Until the socket can be read (or written) without blocking."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    add(sock.fileno(), wake)
    try:
        await ready
    finally:
        remove(sock.fileno())


def _consume(pending: list[memoryview], num_bytes: int) -> None:
    """Drop `num_bytes` from the front of the pending views (what one sendmsg or recvmsg_into moved)."""
    while num_bytes:
        taken = min(num_bytes, len(pending[0]))
        num_bytes -= taken
        pending[0] = pending[0][taken:]
        if not pending[0]:
            pending.pop(0)


async def recv_exactly_into(sock: socket.socket, *views: memoryview) -> None:
    """Fill the views in order (a scatter read: one call can fill several)."""
    pending = [v for v in views if len(v)]
    while pending:
        try:
            received = sock.recvmsg_into(pending[:IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            await _ready(sock, writable=False)
            continue
        if not received:
            raise LaneError("the connection closed mid-frame")
        _consume(pending, received)


async def send_all(sock: socket.socket, pieces: Sequence[Buffer]) -> None:
    """Write the pieces in order, straight from where they lie (a gather write: no joins)."""
    pending = [memoryview(p).cast("B") for p in pieces if len(p)]
    while pending:
        try:
            sent = sock.sendmsg(pending[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _ready(sock, writable=True)
            continue
        _consume(pending, sent)


async def recv_frame(sock: socket.socket, kind: type[M]) -> tuple[M, int]:
    """The next frame, a `kind` message, and its payload's length (the caller reads the payload)."""
    header = bytearray(HEADER.size)
    await recv_exactly_into(sock, memoryview(header))
    frame_bytes, payload_bytes = HEADER.unpack(header)
    if frame_bytes > MAX_FRAME_BYTES or payload_bytes > MAX_PAYLOAD_BYTES:
        raise LaneError(f"frame of {frame_bytes} bytes with a payload of {payload_bytes}: past the lane's limits")
    frame = bytearray(frame_bytes)
    await recv_exactly_into(sock, memoryview(frame))
    return kind.FromString(bytes(frame)), payload_bytes


async def send_frame(sock: socket.socket, frame: Message, payload: Sequence[Buffer] = ()) -> None:
    """The frame, then the payload's pieces in order."""
    encoded = frame.SerializeToString()
    await send_all(sock, [HEADER.pack(len(encoded), sum(len(p) for p in payload)), encoded, *payload])


async def read_answer(
    sock: socket.socket, request: kvcache_pb2.GetRequest
) -> AsyncIterator[tuple[kvcache_pb2.Block, int]]:
    """Send a read request, then yield each answer frame's Block and payload length until the end frame. The
    caller reads each payload before asking for the next frame; an answer that ends in an error is a LaneError."""
    await send_frame(sock, kvcache_pb2.LaneFrame(request=request))
    while True:
        frame, payload_bytes = await recv_frame(sock, kvcache_pb2.LaneFrame)
        if frame.WhichOneof("kind") == "end":
            if frame.end.error:
                raise LaneError(frame.end.error)
            return
        yield frame.block, payload_bytes


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
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(DRAIN_AFTER_ERROR_S):
            while True:
                try:
                    if not sock.recv_into(sink):
                        return
                except (BlockingIOError, InterruptedError):
                    await _ready(sock, writable=False)


def has_pending(sock: socket.socket) -> bool:
    """Whether something (or an EOF) waits to be read: the peer answered before being asked to."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # the next read raises it
    return True


def _is_open(sock: socket.socket) -> bool:
    """An idle connection the peer has not closed (nothing is due on it, so anything readable is an EOF)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


async def connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    family, kind, protocol, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, protocol)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, sockaddr), timeout_s)
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
    alone: logged, closed, nothing else disturbed."""

    def __init__(self, frame_type: type[M]) -> None:
        self.frame_type = frame_type
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @abc.abstractmethod
    async def answer(self, sock: socket.socket, frame: M, payload_bytes: int) -> None:
        """Answer the exchange `frame` begins (its payload still unread), or raise ServiceError."""

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); the port bound."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(64)
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

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(self._serve(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                try:
                    frame, payload_bytes = await recv_frame(sock, self.frame_type)
                except LaneError:
                    return  # closed between exchanges: the normal end of a pooled connection
                try:
                    await self.answer(sock, frame, payload_bytes)
                except ServiceError as error:
                    await send_error(sock, self.frame_type(end=error_end(error)))
                    return
        except (LaneError, OSError) as exc:  # the peer went away or broke the protocol: its loss only
            log.info("bulk lane connection dropped", error=str(exc))
        finally:
            sock.close()


class LanePool:
    """Connections to lanes, by address: each serves one exchange at a time, idle ones are kept for the next."""

    def __init__(self, connect_timeout_s: float = 2.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[str, list[socket.socket]] = {}

    async def acquire(self, address: str) -> socket.socket:
        """An idle connection, else a new one (OSError or TimeoutError when the lane cannot be reached)."""
        return self._take_idle(address) or await connect(address, self.connect_timeout_s)

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
            idle.append(sock)
        else:
            sock.close()

    def _take_idle(self, address: str) -> socket.socket | None:
        idle = self._idle.get(address, [])
        while idle:
            sock = idle.pop()
            if _is_open(sock):
                return sock
            sock.close()
        return None

    def num_idle(self, address: str) -> int:
        return len(self._idle.get(address, []))

    def close(self) -> None:
        for idle in self._idle.values():
            for sock in idle:
                sock.close()
        self._idle.clear()
