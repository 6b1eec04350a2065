"""A real KV store node (its own process, mutual TLS, a real NATS) under the issue's load: 200 idle connections
(160 that never start their handshake, 40 authenticated prefill connections that never ask anything) and 20
half-sent frames (10 block writes that declare 64 MiB and send 256 KiB, 10 frames that declare 16 MiB and send
100 bytes). Its resident memory grows by less than 32 MiB, a normal write and read still complete during it, and
the half-sent frames are dropped at the node's stall limit."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest_asyncio

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import lane, rpc, tls
from mesh.access import PREFILL
from mesh.bus import Bus
from mesh.discovery import WorkerRegistry
from mesh.kv_blocks import KVLayout
from mesh.lane_io import send_frame_bytes, send_raw
from mesh.pb import common_pb2, kvcache_pb2
from services.prefill.prefiller import StoreBlock
from services.prefill.store_client import StoreClient

from .test_lane_bounds import is_closed_within, open_from

MODEL = "lane-memory"
LAYOUT = KVLayout(MODEL, "float16", 16, 4, (2, 1, 16, 8, 128), 1)  # 64 KiB per layer, 256 KiB per block
NODE = "store-memory"
STALL_S = 2.0
MAX_GROWTH_BYTES = 32 * 2**20


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    client: StoreClient
    address: str

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    async def round_trip(self, first: int, num_blocks: int) -> None:
        """A normal write of fresh blocks, then a read of them, over the lane: every byte back."""
        blocks = [
            StoreBlock((first + n).to_bytes(32, "big"), b"\0" * 32, LAYOUT, os.urandom(4 * 64 * 2**10))
            for n in range(num_blocks)
        ]
        await self.client.put(blocks)
        keys = [b.block_hash for b in blocks]
        async with asyncio.timeout(10):
            while self.client.index.num_leading_hits(NODE, keys) < len(keys):
                await asyncio.sleep(0.01)
        got = await self.client.fetch(MODEL, keys)
        assert [g.data for g in got] == [b.data for b in blocks]


@pytest_asyncio.fixture
async def node() -> AsyncIterator[Node]:
    with EmbeddedNats() as nats:
        env = {
            **os.environ,
            "KVMESH_NATS_URL": nats.url,
            "KVMESH_WORKER_ID": NODE,
            "KVMESH_LOG_LEVEL": "warning",
            "KVMESH_HEARTBEAT_INTERVAL_S": "0.2",
            "KVMESH_HTTP_PORT": str(free_port()),
            "KVMESH_CAPACITY_BYTES": str(256 * 2**20),
            "KVMESH_LANE_READ_TIMEOUT_S": str(STALL_S),
            "KVMESH_LANE_HANDSHAKE_TIMEOUT_S": "60",  # the never-started handshakes stay for the whole test
            "KVMESH_LANE_MAX_CONNECTIONS_PER_PEER": "100",  # 60 from this test's prefill address, plus its pool
        }
        process = subprocess.Popen([sys.executable, "-m", "services.kvcache"], env=env)
        bus = await Bus.connect(nats.url, "lane-memory-test")
        registry = WorkerRegistry(bus, [common_pb2.ROLE_KVCACHE], 0.2)
        credentials = tls.load_credentials(PREFILL)
        channels = rpc.Channels(credentials)
        client = StoreClient(registry, channels, timeout_s=30.0, lane_tls=lane.client_tls(credentials))
        try:
            await registry.start()
            await client.start(bus)
            async with asyncio.timeout(30):
                while NODE not in client.lane_addresses():
                    assert process.poll() is None, "the store node exited"
                    await asyncio.sleep(0.05)
            yield Node(process, client, client.lane_addresses()[NODE])
        finally:
            await client.stop()
            await registry.stop()
            await channels.close()
            await bus.close()
            process.terminate()
            process.wait(10)


async def half_sent(address: str, context: object, declared: str) -> socket.socket:
    """An authenticated prefill connection that starts a frame and stops partway."""
    sock = await lane.connect(address, 5.0, context)  # type: ignore[arg-type]
    if declared == "block":  # a write whose block declares 64 MiB, 256 KiB of it sent
        encoded = kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(block_hash=b"\1" * 32)).SerializeToString()
        await send_frame_bytes(sock, lane.HEADER.pack(len(encoded), rpc.MAX_MESSAGE_BYTES), encoded, [])
        await send_raw(sock, [bytes(256 * 2**10)])
    else:  # a frame that declares 16 MiB, 100 bytes of it sent
        await send_raw(sock, [lane.HEADER.pack(lane.MAX_FRAME_BYTES, 0), bytes(100)])
    return sock


async def test_idle_connections_and_half_sent_frames_leave_the_node_bounded_and_serving(node: Node) -> None:
    host, _, port = node.address.rpartition(":")
    assert host == "127.0.0.1"
    context = lane.client_tls(tls.load_credentials(PREFILL))
    await node.round_trip(0, 8)  # warm: the write and read paths, the pool's connection
    baseline = node.rss_bytes()

    never_started = [await open_from(f"127.0.0.{2 + n % 8}", int(port)) for n in range(160)]
    idle = [await lane.connect(node.address, 5.0, context) for _ in range(40)]
    stopped = [await half_sent(node.address, context, "block" if n % 2 else "frame") for n in range(20)]
    await asyncio.sleep(0.5)  # the node has taken every connection and read what was sent
    await node.round_trip(1000, 4)  # normal traffic flows through it all
    growth = node.rss_bytes() - baseline
    assert growth < MAX_GROWTH_BYTES, f"the node grew by {growth / 2**20:.1f} MiB"

    closed = await asyncio.gather(*(is_closed_within(sock, STALL_S + 3.0) for sock in stopped))
    assert all(closed)  # each half-sent frame dropped at the stall limit, its buffers freed
    assert not any([await is_closed_within(sock, 0.01) for sock in idle + never_started[:5]])
    await node.round_trip(2000, 2)
    for sock in never_started + idle + stopped:
        sock.close()
