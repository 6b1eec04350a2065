"""Sealed payloads of many slices, as the store's reads and prefill's pushes send them: moved, sealed and opened by
the lane's worker threads slice by slice, over a real socket pair. Every byte arrives as
sent whatever the split into pieces and views, in both modes; a byte changed in any slice or in the tag, or a
stream cut inside the payload, is the lane's error before the read returns; a peer that stalls mid-payload is
dropped at the stall limit; and the connection's nonces stay in step for the next frame."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from mesh import lane
from mesh.kv_blocks import checksum, checksum_more
from mesh.lane_io import SEAL_SLICE_BYTES, THREAD_BYTES, SealedSocket, send_raw, stall_limit
from mesh.pb import kvcache_pb2

KEYS = (os.urandom(16), os.urandom(16))
PIECE_SIZES = (4 * SEAL_SLICE_BYTES + 5, 17, 2 * SEAL_SLICE_BYTES - 1, SEAL_SLICE_BYTES // 2)  # 7 slices, ragged
assert sum(PIECE_SIZES) >= THREAD_BYTES  # moved by a worker thread
VIEW_SIZES = (1, SEAL_SLICE_BYTES - 3, 3 * SEAL_SLICE_BYTES, sum(PIECE_SIZES) - 4 * SEAL_SLICE_BYTES + 2)
STALL_S = 0.3


def frame(offset: int) -> kvcache_pb2.LaneFrame:
    return kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(offset=offset))


def ends(encrypt: bool) -> tuple[SealedSocket, SealedSocket]:
    near, far = socket.socketpair()
    return SealedSocket(near, KEYS[0], KEYS[1], encrypt), SealedSocket(far, KEYS[1], KEYS[0], encrypt)


async def receive(sock: SealedSocket) -> tuple[int, bytes]:
    """One frame's offset and its payload, read into views of VIEW_SIZES (the last takes what is left)."""
    got, payload_bytes = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    data = bytearray(payload_bytes)
    views, start = [], 0
    for size in VIEW_SIZES:
        views.append(memoryview(data)[start : start + size])
        start += size
    assert start == payload_bytes
    await lane.recv_exactly_into(sock, *views)
    return got.block.offset, bytes(data)


async def wire_of(pieces: list[bytes], encrypt: bool) -> bytes:
    """The bytes a sealed lane puts on the wire for one frame with these payload pieces, then a small one."""
    sender, far = socket.socketpair()
    sealed = SealedSocket(sender, KEYS[0], KEYS[1], encrypt)
    far.setblocking(False)
    loop = asyncio.get_running_loop()

    async def send() -> None:
        await lane.send_frame(sealed, frame(1), pieces)
        await lane.send_frame(sealed, frame(2), [b"next"])
        sealed.close()

    sending = asyncio.create_task(send())
    wire = bytearray()
    while chunk := await loop.sock_recv(far, 2**20):
        wire += chunk
    await sending
    far.close()
    return bytes(wire)


async def read_wire(wire: bytes, encrypt: bool) -> list[tuple[int, bytes]]:
    """The frames a sealed lane reads from `wire`, until its error."""
    near, far = socket.socketpair()
    sealed = SealedSocket(near, KEYS[1], KEYS[0], encrypt)
    far.setblocking(False)
    loop = asyncio.get_running_loop()

    async def feed() -> None:
        await loop.sock_sendall(far, wire)
        far.close()

    feeding = asyncio.create_task(feed())
    got: list[tuple[int, bytes]] = []
    try:
        with stall_limit(STALL_S):
            while True:
                got.append(await receive(sealed) if not got else await receive_small(sealed))
    except lane.LaneError:
        return got
    finally:
        sealed.close()
        feeding.cancel()


async def receive_small(sock: SealedSocket) -> tuple[int, bytes]:
    got, payload_bytes = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    return got.block.offset, await lane.recv_bytes(sock, payload_bytes)


@pytest.mark.parametrize("encrypt", [True, False])
async def test_a_payload_of_many_slices_arrives_byte_for_byte_and_the_next_frame_after_it(encrypt: bool) -> None:
    pieces = [os.urandom(size) for size in PIECE_SIZES]
    sender, receiver = ends(encrypt)
    sending = asyncio.create_task(lane.send_frame(sender, frame(7), pieces))
    assert await receive(receiver) == (7, b"".join(pieces))
    await sending
    await lane.send_frame(sender, frame(8), [b"after"])
    assert await receive_small(receiver) == (8, b"after")
    assert any(thread.name.startswith("lane-io") for thread in threading.enumerate())
    sender.close()
    receiver.close()


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("where", [0.01, 0.3, 0.6, 0.95, -1])  # into the payload's slices; -1: its tag
async def test_a_byte_changed_in_any_slice_or_the_tag_is_the_lanes_error(encrypt: bool, where: float) -> None:
    pieces = [os.urandom(size) for size in PIECE_SIZES]
    wire = bytearray(await wire_of(pieces, encrypt))
    assert await read_wire(bytes(wire), encrypt) == [(1, b"".join(pieces)), (2, b"next")]
    payload_bytes = sum(PIECE_SIZES)
    payload_start = len(wire) - payload_bytes - 16 - (lane.HEADER.size + frame(2).ByteSize() + 16 + 4 + 16)
    at = payload_start + payload_bytes + 3 if where < 0 else payload_start + int(where * payload_bytes)
    wire[at] ^= 0x20
    assert await read_wire(bytes(wire), encrypt) == []


@pytest.mark.parametrize("encrypt", [True, False])
async def test_a_stream_cut_inside_the_payload_is_the_lanes_error(encrypt: bool) -> None:
    wire = await wire_of([os.urandom(size) for size in PIECE_SIZES], encrypt)
    assert await read_wire(wire[: len(wire) // 2], encrypt) == []


async def test_a_peer_that_stalls_mid_payload_is_dropped_at_the_stall_limit() -> None:
    wire = await wire_of([os.urandom(size) for size in PIECE_SIZES], True)
    near, far = socket.socketpair()
    sealed = SealedSocket(near, KEYS[1], KEYS[0], True)
    far.setblocking(False)
    half_sent = asyncio.create_task(send_raw(far, [wire[: 5 * SEAL_SLICE_BYTES // 2]]))  # then nothing
    started = time.monotonic()
    with stall_limit(STALL_S), pytest.raises(lane.LaneError, match="stalled"):
        await receive(sealed)
    assert time.monotonic() - started < STALL_S + 1.0
    await half_sent
    sealed.close()
    far.close()


@pytest.mark.parametrize("encrypt", [True, False, None])  # None: the plain lane
async def test_landed_sees_each_views_bytes_once_in_order_as_they_arrive(encrypt: bool | None) -> None:
    """The reader's hook (a block's running CRC-32C): across worker-received, cipher-opened batches, every view's
    bytes come to it exactly once, opened, in order, and the sum it builds is the view's checksum."""
    pieces = [os.urandom(size) for size in PIECE_SIZES]
    sender: socket.socket
    receiver: socket.socket
    if encrypt is None:
        sender, receiver = socket.socketpair()
        sender.setblocking(False)
        receiver.setblocking(False)
    else:
        sender, receiver = ends(encrypt)
    sending = asyncio.create_task(lane.send_frame(sender, frame(3), pieces))
    got, payload_bytes = await lane.recv_frame(receiver, kvcache_pb2.LaneFrame)
    data = bytearray(payload_bytes)
    views, start = [], 0
    for size in VIEW_SIZES:
        views.append(memoryview(data)[start : start + size])
        start += size
    seen: list[tuple[int, bytes]] = []
    sums = [0] * len(views)

    def landed(n: int, part: memoryview) -> None:
        seen.append((n, bytes(part)))
        sums[n] = checksum_more(part, sums[n])

    await lane.recv_exactly_into(receiver, *views, landed=landed)
    await sending
    assert got.block.offset == 3 and bytes(data) == b"".join(pieces)
    assert [n for n, _ in seen] == sorted(n for n, _ in seen)  # in order
    for n, view in enumerate(views):
        assert b"".join(part for m, part in seen if m == n) == bytes(view)
        assert sums[n] == checksum(view)
    sender.close()
    receiver.close()
