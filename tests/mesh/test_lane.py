"""The bulk lane's frames over a real loopback connection: pieces written from where they lie arrive byte for
byte in the views they are received into, however the kernel splits them; a frame past the limits or a
connection closed mid-frame is a LaneError; the pool reuses a cleanly used connection and drops a broken one;
an error frame reaches a peer still writing."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from mesh import lane
from mesh.pb import common_pb2, kvcache_pb2


async def connected_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    client_task = asyncio.create_task(lane.connect(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=2.0))
    server, _ = await loop.sock_accept(listener)
    server.setblocking(False)
    listener.close()
    return await client_task, server


async def test_a_frame_and_its_pieces_arrive_exactly_in_the_views_they_are_received_into() -> None:
    sender, receiver = await connected_pair()
    pieces = [os.urandom(n) for n in (1, 7, 65536, 3 * 2**20, 0, 5, 9 * 2**20 + 3)]  # past the socket buffers
    frame = kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(offset=4096, first_block=2))
    total = sum(map(len, pieces))

    async def receive() -> tuple[kvcache_pb2.LaneFrame, int, list[bytearray]]:
        got, payload_bytes = await lane.recv_frame(receiver, kvcache_pb2.LaneFrame)
        sizes = [10, total - 10 - 4, 4]  # views that cut across the pieces' boundaries
        views = [bytearray(n) for n in sizes]
        await lane.recv_exactly_into(receiver, *map(memoryview, views))
        return got, payload_bytes, views

    received = asyncio.create_task(receive())
    await lane.send_frame(sender, frame, pieces)
    got, payload_bytes, views = await received
    assert got == frame and payload_bytes == total
    assert b"".join(views) == b"".join(pieces)
    sender.close()
    receiver.close()


async def test_a_connection_closed_mid_frame_or_a_frame_past_the_limits_is_a_lane_error() -> None:
    sender, receiver = await connected_pair()
    await asyncio.get_running_loop().sock_sendall(sender, lane.HEADER.pack(lane.MAX_FRAME_BYTES + 1, 0))
    with pytest.raises(lane.LaneError, match="past the lane's limits"):
        await lane.recv_frame(receiver, kvcache_pb2.LaneFrame)
    await asyncio.get_running_loop().sock_sendall(sender, lane.HEADER.pack(100, 0) + b"only part")
    sender.close()
    with pytest.raises(lane.LaneError, match="closed mid-frame"):
        await lane.recv_frame(receiver, kvcache_pb2.LaneFrame)
    receiver.close()


async def test_the_pool_reuses_a_clean_connection_and_closes_one_that_failed() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    loop = asyncio.get_running_loop()
    accepted: list[socket.socket] = []

    async def accept_forever() -> None:
        while True:
            accepted.append((await loop.sock_accept(listener))[0])

    acceptor = asyncio.create_task(accept_forever())
    pool = lane.LanePool()
    async with pool.connection(address) as first:
        pass
    assert pool.num_idle(address) == 1
    async with pool.connection(address) as second:
        assert second is first  # reused
    with pytest.raises(RuntimeError):
        async with pool.connection(address) as third:
            assert third is first
            raise RuntimeError("an exchange that did not end cleanly")
    assert pool.num_idle(address) == 0 and first.fileno() == -1  # closed, not pooled
    async with pool.connection(address) as fourth:
        assert fourth is not first
    await asyncio.sleep(0.05)
    assert len(accepted) == 2  # one connection per clean run of exchanges, one after the failure
    accepted[1].close()  # the peer goes away while the connection is idle
    await asyncio.sleep(0.05)
    async with pool.connection(address) as fifth:
        assert fifth is not fourth  # an idle connection the peer closed is not handed out
    pool.close()
    acceptor.cancel()
    for sock in accepted:
        sock.close()
    listener.close()


async def test_an_error_frame_reaches_a_peer_that_is_still_writing() -> None:
    """The answering side gives up after one frame while the peer still writes a large payload: the peer can
    finish writing and then read the error (a plain close with bytes unread would reset the connection)."""
    writer, answerer = await connected_pair()
    error = kvcache_pb2.LaneFrame(end=common_pb2.LaneEnd(error="refused", code=3))

    async def refuse() -> None:
        await lane.recv_frame(answerer, kvcache_pb2.LaneFrame)
        await lane.send_error(answerer, error)  # returns once the writer has closed
        answerer.close()  # as LaneListener does after a failed exchange

    refusing = asyncio.create_task(refuse())
    assert not lane.has_pending(writer)
    await lane.send_frame(writer, kvcache_pb2.LaneFrame(block=kvcache_pb2.Block()), [bytes(32 * 2**20)])
    assert lane.has_pending(writer)  # the answer came before it was asked for
    got, payload_bytes = await lane.recv_frame(writer, kvcache_pb2.LaneFrame)
    assert (got, payload_bytes) == (error, 0)
    writer.close()
    await asyncio.wait_for(refusing, 5.0)


def test_the_buffer_pool_reuses_by_size_and_keeps_a_bounded_number_of_bytes() -> None:
    pool = lane.BufferPool(max_bytes=12)
    exact = pool.take(3)
    rounded = [pool.take_at_least(n) for n in (3, 4, 5, 1, 0)]
    assert (len(exact), [len(b) for b in rounded]) == (3, [4, 4, 8, 1, 1])
    pool.give([exact, rounded[0]])
    assert pool.num_bytes == 7 and pool.take_at_least(3) is rounded[0] and pool.take(3) is exact
    pool.give([exact, rounded[0], rounded[1], rounded[2]])  # 3 + 4 + 4 = 11, then the 8 drops the 4s to fit
    assert pool.num_bytes == 11
    assert pool.take_at_least(5) is rounded[2] and pool.take(3) is exact
    fresh = pool.take_at_least(4)
    assert all(fresh is not r for r in rounded) and pool.num_bytes == 0
    pool.give([bytearray(13)])  # past the bound on its own: dropped
    assert pool.num_bytes == 0
