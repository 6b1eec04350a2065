"""The bulk lane's socket I/O (mesh.lane), plain TCP or TLS, driven by the event loop without a thread.

Plain sockets move bytes with gather writes and scatter reads (`sendmsg` of the slices, `recvmsg_into` the views).
TLS sockets (`ssl.SSLSocket`, non-blocking) have neither: their pieces go through `send` one after another (the
small ones joined first, so a frame's header is not a record of its own) and `recv_into` fills one view at a time.
An `SSLWantReadError` means OpenSSL holds no decrypted byte and needs more from the socket; only then does a read
wait for readiness, so bytes already decrypted inside OpenSSL are never waited on.

Memory follows the bytes: `recv_bytes` grows its buffers as bytes arrive (each new piece at most the size of what
already came), so a peer that declares a size and sends nothing holds 64 KiB, not the size it declared. A wait for
readiness is bounded by the stall limit of the task (`stall_limit`): a listener sets it for each connection, so a
peer that stops sending mid-frame is dropped instead of holding its task and buffers for ever.

The peer's identity on a TLS lane is its role, read from its certificate: the URI SAN `spiffe://kvmesh/<role>/...`
(the SPIFFE form of the mesh's certificates, mesh.tls); a certificate without one names no role.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

IOV_MAX = 512  # pieces per sendmsg / recvmsg_into (the kernel allows 1024)
FIRST_PIECE_BYTES = 64 * 2**10  # recv_bytes: the first buffer; each next one at most doubles what arrived
MAX_PIECE_BYTES = 8 * 2**20
JOIN_BELOW_BYTES = 64 * 2**10  # TLS writes: consecutive pieces smaller than this go out as one record
SPIFFE_PREFIX = "spiffe://kvmesh/"

Buffer = bytes | bytearray | memoryview
_stall_limit_s: contextvars.ContextVar[float | None] = contextvars.ContextVar("lane_stall_limit_s", default=None)


class LaneError(ConnectionError):
    """The peer closed the connection, sent a frame that breaks the protocol, or answered with an error."""


@contextlib.contextmanager
def stall_limit(seconds: float | None) -> Iterator[None]:
    """Within the block (and the tasks it starts), a wait for the socket longer than `seconds` is a LaneError."""
    token = _stall_limit_s.set(seconds)
    try:
        yield
    finally:
        _stall_limit_s.reset(token)


async def wait_ready(sock: socket.socket, writable: bool) -> None:
    """Until the socket can be read (or written) without blocking; LaneError past the task's stall limit."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    fd = sock.fileno()
    add(fd, wake)
    try:
        async with asyncio.timeout(_stall_limit_s.get()):
            await ready
    except TimeoutError:
        raise LaneError(f"no progress for {_stall_limit_s.get():g} s: the peer stalled") from None
    finally:
        remove(fd)


def _consume(pending: list[memoryview], num_bytes: int) -> None:
    """Drop `num_bytes` from the front of the pending views (what one sendmsg or recvmsg_into moved)."""
    while num_bytes:
        taken = min(num_bytes, len(pending[0]))
        num_bytes -= taken
        pending[0] = pending[0][taken:]
        if not pending[0]:
            pending.pop(0)


async def recv_exactly_into(sock: socket.socket, *views: memoryview) -> None:
    """Fill the views in order (on a plain socket a scatter read: one call can fill several)."""
    pending = [v for v in views if len(v)]
    is_tls = isinstance(sock, ssl.SSLSocket)
    while pending:
        try:
            received = sock.recv_into(pending[0]) if is_tls else sock.recvmsg_into(pending[:IOV_MAX])[0]
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            await wait_ready(sock, writable=False)
            continue
        except ssl.SSLWantWriteError:
            await wait_ready(sock, writable=True)
            continue
        except ssl.SSLError as exc:
            raise LaneError(f"TLS: {exc}") from exc
        if not received:
            raise LaneError("the connection closed mid-frame")
        _consume(pending, received)


async def recv_bytes(sock: socket.socket, num_bytes: int) -> bytes:
    """The next `num_bytes`, buffered as they arrive: memory held is at most twice what came, plus 64 KiB."""
    pieces: list[bytearray] = []
    size = FIRST_PIECE_BYTES
    remaining = num_bytes
    while remaining:
        piece = bytearray(min(size, remaining))
        await recv_exactly_into(sock, memoryview(piece))
        pieces.append(piece)
        remaining -= len(piece)
        size = min(2 * size, MAX_PIECE_BYTES)
    return b"".join(pieces)


def _tls_pieces(pieces: Sequence[Buffer]) -> list[memoryview]:
    """Consecutive small pieces joined (a header and its frame become one record), large ones left where they lie."""
    out: list[memoryview] = []
    small: list[Buffer] = []
    for piece in pieces:
        if len(piece) < JOIN_BELOW_BYTES:
            small.append(piece)
            continue
        if small:
            out.append(memoryview(b"".join(small)))
            small = []
        out.append(memoryview(piece).cast("B"))
    if small:
        out.append(memoryview(b"".join(small)))
    return [p for p in out if len(p)]


async def send_all(sock: socket.socket, pieces: Sequence[Buffer]) -> None:
    """Write the pieces in order, straight from where they lie (on a plain socket a gather write: no joins)."""
    is_tls = isinstance(sock, ssl.SSLSocket)
    pending = _tls_pieces(pieces) if is_tls else [memoryview(p).cast("B") for p in pieces if len(p)]
    while pending:
        try:
            sent = sock.send(pending[0]) if is_tls else sock.sendmsg(pending[:IOV_MAX])
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            await wait_ready(sock, writable=True)
            continue
        except ssl.SSLWantReadError:
            await wait_ready(sock, writable=False)
            continue
        except ssl.SSLError as exc:
            raise LaneError(f"TLS: {exc}") from exc
        _consume(pending, sent)


def _peek(sock: socket.socket) -> bytes:
    """One byte of what waits on the connection, left there (the raw bytes, for TLS: a record, not plaintext)."""
    return socket.socket.recv(sock, 1, socket.MSG_PEEK)


def has_pending(sock: socket.socket) -> bool:
    """Whether something (or an EOF) waits to be read: the peer answered before being asked to."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        _peek(sock)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # the next read raises it
    return True


def is_idle_open(sock: socket.socket) -> bool:
    """An idle connection still fit for an exchange: nothing is due on it, so anything readable (an EOF, or bytes
    nobody asked for) means the peer closed it or broke it."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    try:
        _peek(sock)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


async def handshake(sock: ssl.SSLSocket) -> None:
    """The TLS handshake on a non-blocking socket; LaneError when it fails (a certificate refused, not TLS)."""
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await wait_ready(sock, writable=False)
        except ssl.SSLWantWriteError:
            await wait_ready(sock, writable=True)
        except (ssl.SSLError, OSError) as exc:
            raise LaneError(f"TLS handshake failed: {exc}") from exc


def server_context(context: ssl.SSLContext) -> ssl.SSLContext:
    """`context` made fit for a lane's server side: the client must present a certificate, and no session
    tickets are sent (TLS 1.3 sends them after the handshake, and on an idle pooled connection any unasked-for
    record would read as the peer closing it)."""
    context.verify_mode = ssl.CERT_REQUIRED
    context.num_tickets = 0
    return context


def role_of(cert: dict[str, Any] | None) -> str | None:
    """The role in a peer's certificate (`ssl.SSLSocket.getpeercert()`): its `spiffe://kvmesh/<role>/<name>` URI
    SAN; None when it has none."""
    if not cert:
        return None
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "URI" and value.startswith(SPIFFE_PREFIX):
            role, _, name = value[len(SPIFFE_PREFIX) :].partition("/")
            if role and name and "/" not in name:
                return str(role)
    return None
