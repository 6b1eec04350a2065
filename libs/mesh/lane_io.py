"""The bulk lane's socket I/O (mesh.lane): plain TCP, or sealed frames after a mutual TLS handshake, driven by the
event loop (and, for large payloads, worker threads).

Plain sockets move bytes with gather writes and scatter reads (`sendmsg` of the slices, `recvmsg_into` the views).
A lane with TLS uses TLS for what it does well, who the peer is: the connection opens with a mutual TLS handshake
(the peer's role is read from its certificate), and the server then sends, inside TLS, two fresh AES-128 keys, one
per direction. From there the connection is a `SealedSocket`: TLS is left (its records went one 16 KiB record per
call through Python's ssl module, at a fifth of the socket's speed), and each frame is sealed with AES-GCM under
those keys (the `cryptography` package): the 8-byte header in the clear but authenticated, the frame encrypted
with its tag after it, the payload encrypted with a second tag after it (or, where the server runs with
KVMESH_LANE_ENCRYPT=false, the payload only authenticated: sent as it lies, its tag a GMAC). Nonces count frames
and payloads per direction, so a frame replayed, reordered, cut or altered fails its tag. A payload is decrypted in
place as it lands in the caller's views; its tag is checked when its last byte is in, before the read that completes
it returns (LaneError otherwise), and a frame is checked before it is parsed.

A payload of THREAD_BYTES or more is moved by a worker thread (`WORKERS`) with blocking socket calls, where the
event loop would wake once per socket buffer and run Python each time. Every pass over a payload's bytes is made by
the thread that moves them, slice by slice (SEAL_SLICE_BYTES), while the slice is in that core's cache: the
receiving worker asks the kernel for a whole slice at once (MSG_WAITALL), opens it in place and passes it to the
caller's `landed` hook (the reader's checksum) before it asks for the next; the sending worker seals a slice into a
reused scratch buffer (its bytes are the store's blocks, never changed) and writes it. So each byte costs each end
the socket's copy plus the cipher and the checksum run on cached bytes, with one thread handoff per payload. (A
cipher thread beside the worker, opening batch n while batch n + 1 came in, cost the reader 15-20% more CPU per
byte, its handoffs and a trip through the shared cache per 2 MiB batch; where both ends share two cores, it only
moved work onto the core the other end needs.) The cipher, CRC-32C and the socket calls run without the GIL. A
worker waits at most IO_PATIENCE_S for the socket: past that the event loop waits (under the stall limit) and a
worker resumes, so a peer that stalls holds no thread. A smaller payload takes the same steps on the event loop. A
payload nobody reads on its way in (the plain lane without a `landed` hook) is received in batches of
MAX_BATCH_BYTES.

Memory follows the bytes: `recv_bytes` grows its buffers as bytes arrive (each new piece at most the size of what
already came), so a peer that declares a size and sends nothing holds 64 KiB, not the size it declared. A wait for
readiness is bounded by the stall limit of the task (`stall_limit`): a listener sets it for each connection, so a
peer that stops sending mid-frame is dropped instead of holding its task and buffers for ever.

The peer's identity is its role, read from its certificate: the URI SAN `spiffe://kvmesh/<role>/<name>` (the
SPIFFE form of the mesh's certificates, mesh.tls); a certificate without one names no role.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import socket
import ssl
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    AEADEncryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mesh.tls import PeerIdentity

IOV_MAX = 512  # pieces per sendmsg / recvmsg_into (the kernel allows 1024)
FIRST_PIECE_BYTES = 64 * 2**10  # recv_bytes: the first buffer; each next one at most doubles what arrived
MAX_PIECE_BYTES = 8 * 2**20
SEAL_SLICE_BYTES = 256 * 2**10  # a payload is sealed and written (received and opened) this much at a time: the
# thread that moves it touches each slice again while it is in that core's cache (L2 here: 2 MiB)
MAX_BATCH_BYTES = 8 * 2**20  # a payload nobody reads on its way in (plain, no `landed`) is received this much a call
THREAD_BYTES = 2**20  # a payload this large is moved by a worker thread; a smaller one by the event loop
IO_PATIENCE_S = 0.05  # a worker's longest wait for the socket before it hands the wait back to the event loop
MAX_WORKERS = 16  # payloads moved at once by one process; more wait their turn
MAX_IDLE_SCRATCH = 8  # sealing buffers kept between frames, for the process
KEY_BYTES = 16  # AES-128
TAG_BYTES = 16

Buffer = bytes | bytearray | memoryview
Landed = Callable[[int, memoryview], None]  # (index of a view, bytes of it now in place and opened), in order
WORKERS = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="lane-io")
_PATIENCE = struct.pack("@ll", 0, int(IO_PATIENCE_S * 1e6))  # a struct timeval, for SO_RCVTIMEO and SO_SNDTIMEO
_idle_scratch: list[bytearray] = []  # written by event loops and workers (list.pop and list.append are atomic)
_stall_limit_s: contextvars.ContextVar[float | None] = contextvars.ContextVar("lane_stall_limit_s", default=None)


def _fresh_workers() -> None:
    """In a forked child: the parent's worker threads are not there, and a pool that counts them would never run."""
    global WORKERS
    WORKERS = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="lane-io")


os.register_at_fork(after_in_child=_fresh_workers)


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


class SealedSocket(socket.socket):
    """A lane connection whose frames are sealed (AES-128-GCM) under the keys its TLS handshake carried. Its state
    is written only by the one task that holds the connection (one exchange at a time)."""

    def __init__(
        self,
        sock: socket.socket,
        send_key: bytes,
        receive_key: bytes,
        encrypt: bool = True,
        peer_cert: dict[str, Any] | None = None,
    ) -> None:
        """Takes over `sock`'s connection (a TLS socket after its handshake is left without closing TLS)."""
        family, kind, proto = sock.family, sock.type, sock.proto
        super().__init__(family, kind, proto, fileno=sock.detach())
        self.setblocking(False)
        self.encrypt = encrypt  # payloads encrypted; False: authenticated only (their tag a GMAC), sent as they lie
        self.peer_cert = peer_cert  # the certificate the handshake checked
        self.send_key = algorithms.AES(send_key)
        self.receive_key = algorithms.AES(receive_key)
        self.send_aead = AESGCM(send_key)  # frames: sealed and opened whole, one call each
        self.receive_aead = AESGCM(receive_key)
        self.num_sent = 0  # segments sealed: each frame, each payload; the nonce of the next
        self.num_received = 0
        self.payload: AEADDecryptionContext | None = None  # the payload being received, opened as it lands
        self.num_payload_left = 0

    def seal_frame(self, header: bytes, encoded: bytes) -> bytes:
        """An encoded frame encrypted, its tag after it (the same bytes `sealer` would give, in one call)."""
        self.num_sent += 1
        return self.send_aead.encrypt(self.num_sent.to_bytes(12, "big"), encoded, header)

    def open_frame(self, header: bytes, sealed: bytes) -> bytes:
        """A sealed frame (its tag after it) opened and checked; LaneError when it fails its tag."""
        self.num_received += 1
        try:
            return self.receive_aead.decrypt(self.num_received.to_bytes(12, "big"), sealed, header)
        except InvalidTag:
            raise LaneError("a sealed frame failed its tag: altered, replayed or cut") from None

    def sealer(self, header: bytes) -> AEADEncryptionContext:
        self.num_sent += 1
        encryptor = Cipher(self.send_key, modes.GCM(self.num_sent.to_bytes(12, "big"))).encryptor()
        encryptor.authenticate_additional_data(header)
        return encryptor

    def opener(self, header: bytes) -> AEADDecryptionContext:
        self.num_received += 1
        decryptor = Cipher(self.receive_key, modes.GCM(self.num_received.to_bytes(12, "big"))).decryptor()
        decryptor.authenticate_additional_data(header)
        return decryptor


def _consume(pending: list[memoryview], num_bytes: int) -> None:
    """Drop `num_bytes` from the front of the pending views (what one sendmsg or recvmsg_into moved)."""
    num_done = 0  # views moved whole
    while num_bytes and num_bytes >= len(pending[num_done]):
        num_bytes -= len(pending[num_done])
        num_done += 1
    del pending[:num_done]
    if num_bytes:
        pending[0] = pending[0][num_bytes:]


async def recv_raw_into(sock: socket.socket, *views: memoryview) -> None:
    """Fill the views in order with the bytes as they come (a scatter read: one call can fill several)."""
    pending = [v for v in views if len(v)]
    while pending:
        try:
            received = sock.recvmsg_into(pending[:IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            await wait_ready(sock, writable=False)
            continue
        if not received:
            raise LaneError("the connection closed mid-frame")
        _consume(pending, received)


async def send_raw(sock: socket.socket, pieces: Sequence[Buffer]) -> None:
    """Write the pieces in order, straight from where they lie (a gather write: no joins)."""
    pending = [memoryview(p).cast("B") for p in pieces if len(p)]
    while pending:
        try:
            sent = sock.sendmsg(pending[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await wait_ready(sock, writable=True)
            continue
        _consume(pending, sent)


async def recv_exactly_into(sock: socket.socket, *views: memoryview, landed: Landed | None = None) -> None:
    """Fill the views in order with the current frame's payload (on a sealed lane: opened in place, and its tag
    checked before the read that completes the payload returns). `landed` is called (on the thread that moved them)
    with each view's bytes as soon as they are in place and opened, in order."""
    num_bytes = sum(map(len, views))
    opener: AEADDecryptionContext | None = None
    tag: bytearray | None = None
    if isinstance(sock, SealedSocket):
        if sock.payload is None or num_bytes > sock.num_payload_left:
            raise LaneError(f"a read of {num_bytes} bytes past the frame's payload")
        opener = sock.payload
        sock.num_payload_left -= num_bytes
        if not sock.num_payload_left:
            sock.payload, tag = None, bytearray(TAG_BYTES)
    in_worker = num_bytes >= THREAD_BYTES
    batch_bytes = SEAL_SLICE_BYTES if opener is not None or landed is not None else MAX_BATCH_BYTES
    incoming = _Incoming(list(_batches(views, batch_bytes)), opener, getattr(sock, "encrypt", True), tag, landed)
    await _drive(sock, incoming.step, False, in_worker)


def _fill(sock: socket.socket, pending: list[memoryview]) -> bool:
    """Receive into the pending views, dropping what is filled; False when the socket has nothing (for now)."""
    while pending:
        try:
            received = sock.recvmsg_into(pending[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, InterruptedError):
            return False
        if not received:
            raise LaneError("the connection closed mid-frame")
        _consume(pending, received)
    return True


def _drain(sock: socket.socket, pending: list[memoryview]) -> bool:
    """Send the pending views, dropping what is sent; False when the socket takes nothing (for now)."""
    while pending:
        try:
            sent = sock.sendmsg(pending[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            return False
        _consume(pending, sent)
    return True


class _Incoming:
    """A payload being received, batch by batch: each batch opened (a sealed lane) and handed to `landed` by the
    thread that received it, right after its bytes are in and while they are still in that core's cache; the tag
    (when this read completes the payload) received with the last batch and checked after it. `step` runs on one
    thread at a time (a worker or the event loop) and resumes where it stopped."""

    def __init__(
        self,
        batches: list[list[tuple[int, memoryview]]],
        opener: AEADDecryptionContext | None,
        encrypt: bool,
        tag: bytearray | None,
        landed: Landed | None,
    ) -> None:
        self.batches = batches
        self.opener = opener
        self.encrypt = encrypt
        self.tag = tag
        self.landed = landed
        self.num_in = 0  # batches whose bytes are in, opened and handed over
        self.pending = self._views(0)
        self._opened: memoryview | None = None  # where a slice is decrypted, then copied back (see _open)

    def _views(self, n: int) -> list[memoryview]:
        views = [part for _, part in self.batches[n]] if n < len(self.batches) else []
        return [*views, memoryview(self.tag)] if self.tag is not None and n >= len(self.batches) - 1 else views

    def step(self, sock: socket.socket) -> bool:
        """Receive what the socket holds; True once the whole read is in place, opened and checked."""
        while True:
            if not _fill(sock, self.pending):
                return False
            if self.num_in < len(self.batches):
                self._finish(self.batches[self.num_in])
                self.num_in += 1
            if self.num_in >= len(self.batches):
                break
            self.pending = self._views(self.num_in)
        if self.opener is not None and self.tag is not None:
            _finalize(self.opener, self.tag)
        return True

    def _finish(self, batch: list[tuple[int, memoryview]]) -> None:
        for n, part in batch:
            if self.opener is not None and self.encrypt:
                self._open(self.opener, part)
            elif self.opener is not None:
                self.opener.authenticate_additional_data(part)
            if self.landed is not None:
                self.landed(n, part)

    def _open(self, opener: AEADDecryptionContext, part: memoryview) -> None:
        """Decrypt `part` in place. Recent cryptography (51 here) refuses overlapping buffers ("data and buf must
        not overlap"), so through a slice-sized buffer of this read's own: one more copy, of a slice still in the
        core's cache. GCM's update_into asks for 15 bytes of room past the data."""
        if self._opened is None or len(self._opened) < len(part) + 15:
            self._opened = memoryview(bytearray(max(len(part), SEAL_SLICE_BYTES) + 15))
        num_bytes = opener.update_into(part, self._opened)
        part[:num_bytes] = self._opened[:num_bytes]


class _Outgoing:
    """A frame being sent: `first` (its header and frame), then the payload slice by slice, each sealed (or, not
    `encrypt`, only authenticated) just before it is written, by the thread that writes it, so the socket's copy
    reads it from cache; the tag after the last. `step` runs on one thread at a time (a worker or the event loop)
    and resumes where it stopped."""

    def __init__(
        self,
        first: list[memoryview],
        slices: list[list[tuple[int, memoryview]]],
        sealer: AEADEncryptionContext | None,
        encrypt: bool,
    ) -> None:
        self.slices = slices
        self.sealer = sealer
        self.scratch = _take_scratch() if sealer is not None and encrypt and slices else None
        self.num_done = 0  # slices prepared for the socket
        self.pending = [view for view in first if len(view)]

    def step(self, sock: socket.socket) -> bool:
        """Write what the socket takes; True once every byte (and the tag) is written."""
        while _drain(sock, self.pending):
            if self.num_done == len(self.slices):
                return True
            self.pending = self._prepare(self.num_done)
            self.num_done += 1
        return False

    def _prepare(self, n: int) -> list[memoryview]:
        parts = [part for _, part in self.slices[n]]
        if self.sealer is None:
            return parts
        prepared = _seal(self.sealer, parts, self.scratch)
        if n + 1 < len(self.slices):
            return prepared
        self.sealer.finalize()
        return [*prepared, memoryview(self.sealer.tag)]

    def release(self) -> None:
        """Give the scratch buffer back (no thread holds it once the exchange's worker has settled)."""
        if self.scratch is not None:
            _give_scratch(self.scratch)
            self.scratch = None


async def _drive(sock: socket.socket, step: Callable[[socket.socket], bool], writable: bool, in_worker: bool) -> None:
    """Run `step` until it returns True: in a worker (`in_worker`, the socket blocking for the step, each call
    waiting at most IO_PATIENCE_S) or on the event loop (the socket non-blocking); whenever it stops short, the
    event loop waits for the socket, under the task's stall limit."""
    while not (await _in_worker(sock, step) if in_worker else step(sock)):
        await wait_ready(sock, writable)


async def _in_worker(sock: socket.socket, step: Callable[[socket.socket], bool]) -> bool:
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[bool] = loop.create_future()
    job = WORKERS.submit(_blocking_step, sock, step, loop, finished)
    try:
        return await finished
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):  # a cancelled exchange's connection is never reused: end the worker's wait
            sock.shutdown(socket.SHUT_RDWR)
        await _settle(job)
        raise


def _blocking_step(
    sock: socket.socket,
    step: Callable[[socket.socket], bool],
    loop: asyncio.AbstractEventLoop,
    finished: asyncio.Future[bool],
) -> None:
    """`step` with the socket blocking, each call bounded by IO_PATIENCE_S without progress (in a worker); its
    outcome is handed to the event loop's `finished` once the socket is non-blocking again (one wake-up, where
    a concurrent future wrapped by asyncio takes a lock and a callback chain)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _PATIENCE)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _PATIENCE)
        sock.setblocking(True)
        try:
            outcome = step(sock)
        finally:
            sock.setblocking(False)
    except BaseException as exc:  # the awaiting task raises it
        _hand_back(loop, finished, False, exc)
    else:
        _hand_back(loop, finished, outcome, None)


def _hand_back(
    loop: asyncio.AbstractEventLoop, finished: asyncio.Future[bool], outcome: bool, error: BaseException | None
) -> None:
    def resolve() -> None:
        if finished.done():  # the task was cancelled
            return
        if error is not None:
            finished.set_exception(error)
        else:
            finished.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
        loop.call_soon_threadsafe(resolve)


async def _settle(job: Future[Any] | None) -> None:
    """Until a worker has left the socket and the buffers its job was given (a job not started yet never starts)."""
    if job is None or job.cancel() or job.done():
        return
    waiter = asyncio.wrap_future(job)
    await asyncio.wait([waiter])
    if not waiter.cancelled():
        waiter.exception()  # retrieved: the exchange's own error is the one that propagates


def _seal(sealer: AEADEncryptionContext, parts: list[memoryview], out: memoryview | None) -> list[memoryview]:
    """What to send of a slice: the parts encrypted into `out`, or with no `out` only authenticated (the parts)."""
    if out is None:
        for part in parts:
            sealer.authenticate_additional_data(part)
        return parts
    filled = 0
    for part in parts:
        sealer.update_into(part, out[filled : filled + len(part)])
        filled += len(part)
    return [out[:filled]]


def _finalize(opener: AEADDecryptionContext, tag: bytearray) -> None:
    try:
        opener.finalize_with_tag(bytes(tag))
    except InvalidTag:
        raise LaneError("a sealed frame failed its tag: altered, replayed or cut") from None


def _take_scratch() -> memoryview:
    try:
        return memoryview(_idle_scratch.pop())
    except IndexError:
        return memoryview(bytearray(SEAL_SLICE_BYTES))


def _give_scratch(view: memoryview) -> None:
    if len(_idle_scratch) < MAX_IDLE_SCRATCH:
        _idle_scratch.append(view.obj)  # type: ignore[arg-type]


def _batches(views: Sequence[memoryview], max_bytes: int) -> Iterator[list[tuple[int, memoryview]]]:
    """The views in order, cut and grouped into batches of at most `max_bytes`: (index of the view, part of it)."""
    batch: list[tuple[int, memoryview]] = []
    num_bytes = 0
    for n, view in enumerate(views):
        parts = (
            (view,) if len(view) <= max_bytes else (view[at : at + max_bytes] for at in range(0, len(view), max_bytes))
        )
        for part in parts:
            if num_bytes + len(part) > max_bytes:
                yield batch
                batch, num_bytes = [], 0
            batch.append((n, part))
            num_bytes += len(part)
    if batch:
        yield batch


async def _recv_pieces(sock: socket.socket, num_bytes: int, read: Any = recv_raw_into) -> bytes:
    """`num_bytes` read with `read`, buffered as they arrive: each new piece at most the size of what came."""
    pieces: list[bytearray] = []
    size = FIRST_PIECE_BYTES
    remaining = num_bytes
    while remaining:
        piece = bytearray(min(size, remaining))
        await read(sock, memoryview(piece))
        pieces.append(piece)
        remaining -= len(piece)
        size = min(2 * size, MAX_PIECE_BYTES)
    return b"".join(pieces)


async def recv_bytes(sock: socket.socket, num_bytes: int) -> bytes:
    """The next `num_bytes` of the frame's payload, buffered as they arrive: memory held is at most twice what
    came, plus 64 KiB."""
    return await _recv_pieces(sock, num_bytes, recv_exactly_into)


async def recv_frame_bytes(sock: socket.socket, header: bytes, frame_bytes: int, payload_bytes: int) -> bytes:
    """The encoded frame after `header` (on a sealed lane: opened and checked), its payload left to read."""
    if not isinstance(sock, SealedSocket):
        return await _recv_pieces(sock, frame_bytes)
    if sock.payload is not None:
        raise LaneError("a frame read before the last one's payload")
    encoded = sock.open_frame(header, await _recv_pieces(sock, frame_bytes + TAG_BYTES))
    if payload_bytes:
        sock.payload, sock.num_payload_left = sock.opener(header), payload_bytes
    return encoded


async def send_frame_bytes(sock: socket.socket, header: bytes, encoded: bytes, payload: Sequence[Buffer]) -> None:
    """The header, the encoded frame and the payload's pieces (on a sealed lane: each sealed on its way out)."""
    views = [memoryview(p).cast("B") for p in payload if len(p)]
    num_bytes = sum(map(len, views))
    in_worker = num_bytes >= THREAD_BYTES
    if not isinstance(sock, SealedSocket):  # one gather write of it all
        outgoing = _Outgoing([memoryview(header), memoryview(encoded), *views], [], None, False)
    else:
        first = [memoryview(header), memoryview(sock.seal_frame(header, encoded))]
        sealer = sock.sealer(header) if views else None
        outgoing = _Outgoing(first, list(_batches(views, SEAL_SLICE_BYTES)), sealer, sock.encrypt)
    try:
        await _drive(sock, outgoing.step, True, in_worker)
    finally:
        outgoing.release()


async def send_all(sock: socket.socket, pieces: Sequence[Buffer]) -> None:
    """Write the pieces in order as they are: on a sealed lane only for bytes that need no protection."""
    await send_raw(sock, pieces)


def _peek(sock: socket.socket) -> bytes:
    """One byte of what waits on the connection, left there."""
    return sock.recv(1, socket.MSG_PEEK)


def has_pending(sock: socket.socket) -> bool:
    """Whether something (or an EOF) waits to be read: the peer answered before being asked to."""
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
    try:
        _peek(sock)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


async def _tls_step(tls: ssl.SSLSocket, step: Any) -> Any:
    """`step()` on a non-blocking TLS socket, waiting for the socket as OpenSSL asks; LaneError when TLS fails."""
    while True:
        try:
            return step()
        except ssl.SSLWantReadError:
            await wait_ready(tls, writable=False)
        except ssl.SSLWantWriteError:
            await wait_ready(tls, writable=True)
        except (ssl.SSLError, OSError) as exc:
            raise LaneError(f"TLS handshake failed: {exc}") from exc


async def handshake(tls: ssl.SSLSocket) -> None:
    """The TLS handshake on a non-blocking socket; LaneError when it fails (a certificate refused, not TLS)."""
    await _tls_step(tls, tls.do_handshake)


async def seal_as_server(tls: ssl.SSLSocket, encrypt: bool = True) -> SealedSocket:
    """After the handshake: send the connection's keys (and whether payloads are encrypted) inside TLS, then leave
    TLS for sealed frames. The client speaks first after this, so no byte of the sealed lane can reach OpenSSL's
    buffers."""
    keys = os.urandom(2 * KEY_BYTES) + bytes([encrypt])  # client to server, server to client, the mode
    sent = 0
    while sent < len(keys):
        sent += await _tls_step(tls, lambda start=sent: tls.send(keys[start:]))
    return SealedSocket(tls, keys[KEY_BYTES : 2 * KEY_BYTES], keys[:KEY_BYTES], encrypt, tls.getpeercert())


async def seal_as_client(tls: ssl.SSLSocket) -> SealedSocket:
    """After the handshake: read the connection's keys inside TLS (a refused certificate is an alert here), then
    leave TLS for sealed frames."""
    keys = bytearray(2 * KEY_BYTES + 1)
    view = memoryview(keys)
    received = 0
    while received < len(keys):
        count = await _tls_step(tls, lambda start=received: tls.recv_into(view[start:]))
        if not count:
            raise LaneError("the lane closed the connection during its handshake")
        received += count
    send_key, receive_key, encrypt = bytes(keys[:KEY_BYTES]), bytes(keys[KEY_BYTES : 2 * KEY_BYTES]), keys[-1] == 1
    return SealedSocket(tls, send_key, receive_key, encrypt, tls.getpeercert())


def server_context(context: ssl.SSLContext) -> ssl.SSLContext:
    """`context` made fit for a lane's server side: the client must present a certificate, and no session
    tickets are sent (TLS 1.3 sends them after the handshake: bytes inside TLS that nobody would read)."""
    context.verify_mode = ssl.CERT_REQUIRED
    context.num_tickets = 0
    return context


def role_of(cert: dict[str, Any] | None) -> str | None:
    """The role in a peer's certificate (`ssl.SSLSocket.getpeercert()`): its `spiffe://kvmesh/<role>/<name>` URI
    SAN, read as mesh.tls reads every identity; None when it has none."""
    for kind, value in (cert or {}).get("subjectAltName", ()):
        identity = PeerIdentity.parse(str(value)) if kind == "URI" else None
        if identity is not None:
            return identity.role
    return None
