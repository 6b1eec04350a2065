"""What one peer can hold on a bulk lane, on real loopback sockets: connections past the caps per peer address and
in all are closed at accept; an idle connection is closed at the idle limit; a frame or exchange that stops
moving is dropped at the stall limit, one that trickles at the exchange deadline; a header past the lane's limits
(4 GiB) is refused before anything is allocated, and a declared size is buffered only as its bytes arrive."""

from __future__ import annotations

import asyncio
import os
import socket
import tracemalloc
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from mesh import lane
from mesh.config import LaneSettings, SettingError
from mesh.lane_io import FIRST_PIECE_BYTES
from mesh.pb import kvcache_pb2

from .echo_lane import EchoLane, echo
from .test_lane import connected_pair

FAST = LaneSettings(
    lane_max_connections=5,
    lane_max_connections_per_peer=3,
    lane_idle_timeout_s=0.4,
    lane_read_timeout_s=0.4,
    lane_exchange_timeout_s=1.5,
)


@pytest_asyncio.fixture
async def echo_lane() -> AsyncIterator[tuple[EchoLane, int]]:
    listener = EchoLane(FAST)
    port = await listener.start("127.0.0.1", 0)
    yield listener, port
    await listener.stop()


async def open_from(source: str, port: int) -> socket.socket:
    """A connection to the lane from `source` (any 127.x.y.z is this machine's loopback)."""
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((source, 0))
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def is_closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the lane closes the connection within `seconds` (sending nothing before)."""
    try:
        async with asyncio.timeout(seconds):
            return await asyncio.get_running_loop().sock_recv(sock, 1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def test_connections_past_the_caps_per_peer_and_in_all_are_closed_at_accept(
    echo_lane: tuple[EchoLane, int],
) -> None:
    listener, port = echo_lane
    first = [await open_from("127.0.0.2", port) for _ in range(3)]
    over_peer = await open_from("127.0.0.2", port)
    assert await is_closed_within(over_peer, 2.0)
    others = [await open_from("127.0.0.3", port) for _ in range(2)]
    over_all = await open_from("127.0.0.4", port)
    assert await is_closed_within(over_all, 2.0)
    assert not any([await is_closed_within(s, 0.05) for s in first + others])
    assert (listener.num_refused, listener.num_connections) == (2, 5)
    for sock in first + others + [over_peer, over_all]:
        sock.close()
    await asyncio.sleep(0.1)
    assert listener.num_connections == 0
    sock = await lane.connect(f"127.0.0.1:{port}", 2.0)  # room again
    assert await echo(sock, b"after") == b"after"
    sock.close()


async def test_an_idle_connection_is_closed_at_the_idle_limit_but_not_before(echo_lane: tuple[EchoLane, int]) -> None:
    _, port = echo_lane
    sock = await lane.connect(f"127.0.0.1:{port}", 2.0)
    assert await echo(sock, b"one") == b"one"
    assert not await is_closed_within(sock, 0.2)
    assert await echo(sock, b"two") == b"two"  # an exchange restarts the idle clock
    assert await is_closed_within(sock, 1.0)
    sock.close()


@pytest.mark.parametrize(
    "sent",
    [
        lane.HEADER.pack(1000, 0) + b"\x0a" * 10,  # a frame cut short
        lane.HEADER.pack(2, 100) + b"\x0a\x00" + b"x" * 40,  # a payload cut short
        lane.HEADER.pack(2, 2**20)[:5],  # a header cut short
    ],
)
async def test_an_exchange_that_stops_moving_is_dropped_at_the_stall_limit(
    echo_lane: tuple[EchoLane, int], sent: bytes
) -> None:
    _, port = echo_lane
    sock = await lane.connect(f"127.0.0.1:{port}", 2.0)
    await asyncio.get_running_loop().sock_sendall(sock, sent)
    assert not await is_closed_within(sock, 0.2)
    assert await is_closed_within(sock, 1.0)
    sock.close()


async def test_an_exchange_that_trickles_is_dropped_at_the_exchange_deadline(echo_lane: tuple[EchoLane, int]) -> None:
    _, port = echo_lane
    sock = await lane.connect(f"127.0.0.1:{port}", 2.0)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, lane.HEADER.pack(2, 1000) + b"\x0a\x00")
    started = loop.time()
    closed = False
    while not closed and loop.time() - started < 4.0:
        await loop.sock_sendall(sock, b"x")  # a byte well within each stall limit
        closed = await is_closed_within(sock, 0.2)
    assert closed and 1.4 < loop.time() - started < 2.5
    sock.close()


async def test_a_header_that_declares_4_gib_is_refused_without_allocating() -> None:
    sender, receiver = await connected_pair()
    loop = asyncio.get_running_loop()
    for frame_bytes, payload_bytes in ((2**32 - 1, 0), (10, 2**32 - 1)):
        await loop.sock_sendall(sender, lane.HEADER.pack(frame_bytes, payload_bytes))
        tracemalloc.start()
        with pytest.raises(lane.LaneError, match="past the lane's limits"):
            await lane.recv_frame(receiver, kvcache_pb2.LaneFrame)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 * 2**10
    sender.close()
    receiver.close()


async def test_a_declared_size_is_buffered_only_as_its_bytes_arrive() -> None:
    sender, receiver = await connected_pair()
    loop = asyncio.get_running_loop()
    sent = os.urandom(2**20)
    await loop.sock_sendall(sender, sent)
    sender.close()
    tracemalloc.start()
    with pytest.raises(lane.LaneError, match="closed mid-frame"):
        await lane.recv_bytes(receiver, 1024 * 2**20)  # declared 1 GiB, 1 MiB came
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    receiver.close()
    assert 2**20 < peak < 2 * 2**20 + 2 * FIRST_PIECE_BYTES


def test_lane_limits_must_be_positive() -> None:
    with pytest.raises(SettingError, match="KVMESH_LANE_IDLE_TIMEOUT_S=0"):
        LaneSettings(lane_idle_timeout_s=0)
