"""Three real KV store nodes (serve(), in this process) on a real NATS with JetStream, and the prefill side's
StoreClient writing 2+1 erasure-coded blocks: stopping any node loses no block, a node that returns with its SSD
announces its fragments again, a replacement node gets the lost fragments back by repair, and a new follower
rebuilds the global index by replaying the stream."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from engine_core.config import ModelConfig
from engine_core.models.deepseek_v4.transfer import block_sections
from engine_core.tiny_v4 import DEEPSEEK_V4_TINY_CONFIG
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import lane, rpc, tls
from mesh.access import PREFILL
from mesh.bus import Bus
from mesh.discovery import WorkerRegistry
from mesh.erasure import Protection
from mesh.kv_blocks import KVLayout, checksum, layout_to_proto
from mesh.kv_index import Coding, GlobalKVIndex
from mesh.kv_stream import KVEventFollower
from mesh.pb import common_pb2, kvcache_pb2
from mesh.protection_price import PricedProtection
from services.kvcache.config import KVCacheSettings
from services.kvcache.server import serve
from services.prefill.prefiller import StoreBlock
from services.prefill.store_client import StoreClient
from services.prefill.store_reads import Source, plan_reads

from .harness import serving, wait_until

LAYOUT = KVLayout("m", "float32", 16, 2, (2, 1, 16, 1, 8), 1)  # 2 layers of (k, v) x 16 tokens x 8: 2 KiB
ROOT = b"\0" * 32


def chain_blocks(count: int, seed: int) -> list[StoreBlock]:
    keys = [bytes([seed, i]) * 16 for i in range(count)]
    size = LAYOUT.num_layers * LAYOUT.chunk_bytes(1)
    return [StoreBlock(key, keys[i - 1] if i else ROOT, LAYOUT, os.urandom(size)) for i, key in enumerate(keys)]


class Node:
    def __init__(self, nats_url: str, worker_id: str, data_dir: Path | None) -> None:
        self.settings = KVCacheSettings(
            nats_url=nats_url,
            grpc_port=free_port(),
            http_port=free_port(),
            worker_id=worker_id,
            heartbeat_interval_s=0.2,
            log_level="warning",
            data_dir=str(data_dir) if data_dir else "",
            repair_interval_s=0.2,
            repair_delay_s=0.3,
            drain_timeout_s=2.0,
        )
        self._stack: contextlib.AsyncExitStack | None = None

    async def start(self) -> Node:
        self._stack = contextlib.AsyncExitStack()
        await self._stack.enter_async_context(serving(serve, self.settings))
        return self

    async def stop(self) -> None:
        assert self._stack is not None
        await self._stack.aclose()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, Node], StoreClient, Path]]:
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        nodes = {f"kv-{i}": await Node(nats.url, f"kv-{i}", tmp_path / "ssd").start() for i in range(3)}
        bus = await Bus.connect(nats.url, "test-client")
        registry = WorkerRegistry(bus, [common_pb2.ROLE_KVCACHE], 0.2)
        await registry.start()
        credentials = tls.load_credentials(PREFILL)
        channels = rpc.Channels(credentials)
        client = StoreClient(
            registry, channels, timeout_s=5.0, protection=Protection(2, 1), lane_tls=lane.client_tls(credentials)
        )
        await client.start(bus)
        await wait_until(_async(lambda: len(client.nodes()) == 3))
        try:
            yield nats.url, nodes, client, tmp_path
        finally:
            await client.stop()
            await registry.stop()
            await channels.close()
            for node in nodes.values():
                with contextlib.suppress(Exception):
                    await node.stop()
            await bus.close()


def _async(condition):
    async def check() -> bool:
        return condition()

    return check


def fragments_on(client: StoreClient, key: bytes, live: set[str]) -> dict[str, int]:
    return {w: h.fragment_index for w, h in client.index.holders(key).items() if w in live}


async def test_a_stopped_node_loses_no_block_and_a_replacement_is_repaired(cluster) -> None:
    nats_url, nodes, client, tmp_path = cluster
    blocks = chain_blocks(8, seed=1)
    keys = [b.block_hash for b in blocks]
    await client.put(blocks)
    every = {"kv-0", "kv-1", "kv-2"}
    await wait_until(_async(lambda: all(sorted(fragments_on(client, k, every).values()) == [0, 1, 2] for k in keys)))
    assert await client.fetch("m", keys) == blocks
    assert await client.fetch("m", [bytes(32)]) == []  # the index says no: not a single call
    assert client.stored([*keys, bytes(32)]) == [True] * 8 + [False]  # what prefill asks before any engine call

    for stopped in sorted(nodes):  # any one node: every block is still read back, decoded from the other two
        await nodes[stopped].stop()
        await wait_until(_async(lambda stopped=stopped: stopped not in client.nodes()))
        assert await client.fetch("m", keys) == blocks, f"with {stopped} stopped"
        nodes[stopped] = await Node(nats_url, stopped, tmp_path / "ssd").start()  # back, with its SSD
        await wait_until(_async(lambda stopped=stopped: all(stopped in fragments_on(client, k, every) for k in keys)))

    # kv-1 is lost for good and kv-3 (empty) replaces it: repair rebuilds kv-1's fragments on kv-3
    await nodes.pop("kv-1").stop()
    nodes["kv-3"] = await Node(nats_url, "kv-3", None).start()
    live = {"kv-0", "kv-2", "kv-3"}
    await wait_until(
        _async(lambda: all(sorted(fragments_on(client, k, live).values()) == [0, 1, 2] for k in keys)), timeout_s=15
    )
    await nodes.pop("kv-0").stop()  # and now any other node can go
    assert await client.fetch("m", keys) == blocks


async def test_a_new_follower_rebuilds_the_index_by_replay(cluster) -> None:
    nats_url, _, client, _ = cluster
    blocks = chain_blocks(40, seed=2)
    await client.put(blocks)
    await wait_until(_async(lambda: client.index.num_blocks() == 40))
    bus = await Bus.connect(nats_url, "test-replay")
    index = GlobalKVIndex()
    follower = KVEventFollower(bus, index, tiers=frozenset({"host", "ssd"}))
    try:
        await follower.start()
        assert await follower.wait_caught_up(timeout_s=10)
        assert follower.replay_seconds is not None and follower.replay_seconds < 5
        assert [index.holders(b.block_hash) for b in blocks] == [client.index.holders(b.block_hash) for b in blocks]
    finally:
        await follower.stop()
        await bus.close()


@pytest.mark.parametrize("over_lanes", [True, False], ids=["bulk-lane", "grpc"])
async def test_a_layer_stream_writes_each_layer_once_complete_and_the_last_after_the_checksums(
    cluster, over_lanes: bool
) -> None:
    _, nodes, client, _ = cluster
    client.use_lanes = over_lanes
    lanes = {w.worker_id: w.info.data_address for w in client.registry.workers(common_pb2.ROLE_KVCACHE)}
    assert sorted(lanes) == ["kv-0", "kv-1", "kv-2"] and all(lanes.values())  # every node announces its lane
    blocks = chain_blocks(6, seed=3)
    keys = [b.block_hash for b in blocks]
    await client.put(blocks)
    every = {"kv-0", "kv-1", "kv-2"}
    await wait_until(_async(lambda: all(sorted(fragments_on(client, k, every).values()) == [0, 1, 2] for k in keys)))
    stream = client.plan_stream("m", [*keys, bytes(32)])
    assert stream is not None and stream.block_hashes == keys  # ends where the index says the prefix ends
    written: list[tuple[int, list[bytes]]] = []
    assert await stream.run(
        LAYOUT, len(keys), lambda layer, pieces: written.append((layer, [bytes(p) for p in pieces]))
    )
    size = LAYOUT.chunk_bytes(1)
    assert [layer for layer, _ in written] == list(range(LAYOUT.num_layers))
    assert all(pieces == [b.data[layer * size : (layer + 1) * size] for b in blocks] for layer, pieces in written)
    # the lane's connections are pooled after a clean read; over gRPC none were opened
    assert [client.lanes.num_idle(a) for a in lanes.values()] == ([1, 1, 1] if over_lanes else [0, 0, 0])

    # a node that dies after the plan was made: its blocks are read whole from the others (parity decoded)
    stream = client.plan_stream("m", keys)
    assert stream is not None
    await nodes.pop("kv-1").stop()
    written.clear()
    assert await stream.run(
        LAYOUT, len(keys), lambda layer, pieces: written.append((layer, [bytes(p) for p in pieces]))
    )
    assert all(pieces == [b.data[layer * size : (layer + 1) * size] for b in blocks] for layer, pieces in written)
    await wait_until(_async(lambda: "kv-1" not in client.nodes()))
    assert client.plan_stream("m", keys) is None  # now some blocks need parity: fetch decodes them instead
    assert await client.fetch("m", keys) == blocks


async def test_v4_blocks_stream_layer_by_layer_and_are_a_miss_in_another_layout(cluster) -> None:
    """Block format 2 (deepseek-v4-tiny's sections, fp32: layers of 4096, 8704, 4352 and 8704 bytes) coded 2+1 on
    the real nodes: read whole, or streamed with each layer's sections written once complete. A reader expecting
    another layout (a V3 worker under the same keys) finds a layout mismatch and writes nothing: a miss."""
    _, _, client, _ = cluster
    config = ModelConfig.from_hf(DEEPSEEK_V4_TINY_CONFIG)
    assert config.v4 is not None
    v4 = KVLayout("m", "float32", 16, 4, (), 0, block_format=2, block_sections=block_sections(config.v4, 16))
    keys = [bytes([4, i]) * 16 for i in range(3)]
    blocks = [StoreBlock(key, keys[i - 1] if i else ROOT, v4, os.urandom(25_856)) for i, key in enumerate(keys)]
    await client.put(blocks)
    every = {"kv-0", "kv-1", "kv-2"}
    await wait_until(_async(lambda: all(sorted(fragments_on(client, k, every).values()) == [0, 1, 2] for k in keys)))
    assert await client.fetch("m", keys) == blocks
    offsets = v4.layer_offsets()
    written: list[tuple[int, list[bytes]]] = []
    for over_lanes in (True, False):
        client.use_lanes = over_lanes
        stream = client.plan_stream("m", keys)
        assert stream is not None
        written.clear()
        assert await stream.run(v4, 3, lambda layer, pieces: written.append((layer, [bytes(p) for p in pieces])))
        assert [(layer, [len(p) for p in pieces]) for layer, pieces in written] == [
            (layer, [offsets[layer + 1] - offsets[layer]] * 3) for layer in range(4)
        ]
        assert all(pieces == [b.data[offsets[i] : offsets[i + 1]] for b in blocks] for i, pieces in written)
        v3 = LAYOUT  # format 1, the same model name: the headers' layout is not the one expected
        stream = client.plan_stream("m", keys)
        assert stream is not None
        written.clear()
        assert not await stream.run(v3, 3, lambda layer, pieces: written.append((layer, [])))
        assert written == []


async def test_the_bulk_lane_answers_a_bad_request_with_its_error_and_goes_on_serving(cluster) -> None:
    _, _, client, _ = cluster
    blocks = chain_blocks(2, seed=5)
    await client.put(blocks)
    address = next(
        w.info.data_address for w in client.registry.workers(common_pb2.ROLE_KVCACHE) if w.worker_id == "kv-0"
    )
    sock = await lane.connect(address, 2.0, client.lanes.ssl_context)
    await lane.send_frame(
        sock,
        kvcache_pb2.LaneFrame(
            request=kvcache_pb2.GetRequest(
                block_hashes=[blocks[0].block_hash], model="m", skip_missing=True, slice_bytes=-1
            )
        ),
    )
    frame, payload_bytes = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    assert frame.end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and payload_bytes == 0
    assert "slice_bytes must not be negative" in frame.end.error
    with pytest.raises(lane.LaneError, match="closed"):  # the node closed this connection
        await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    sock.close()

    sock = await lane.connect(address, 2.0, client.lanes.ssl_context)  # a new one is served; and the model is required
    await lane.send_frame(
        sock, kvcache_pb2.LaneFrame(request=kvcache_pb2.GetRequest(block_hashes=[blocks[0].block_hash], slice_bytes=64))
    )
    frame, _ = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    assert frame.end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "model is required" in frame.end.error
    sock.close()

    # whole (slice_bytes 0): each header with its bytes
    sock = await lane.connect(address, 2.0, client.lanes.ssl_context)
    await lane.send_frame(
        sock,
        kvcache_pb2.LaneFrame(
            request=kvcache_pb2.GetRequest(block_hashes=[b.block_hash for b in blocks], model="m", skip_missing=True)
        ),
    )
    for block in blocks:  # 2+1 over three nodes: this one holds a fragment of each
        frame, payload_bytes = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
        assert frame.block.block_hash == block.block_hash and not frame.block.data
        assert payload_bytes == len(block.data) // 2  # a data or parity fragment: half the block
        fragment = bytearray(payload_bytes)
        await lane.recv_exactly_into(sock, memoryview(fragment))
        assert checksum(fragment) == frame.block.checksum
    frame, _ = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    assert frame.WhichOneof("kind") == "end" and not frame.end.error
    sock.close()

    sock = await lane.connect(address, 2.0, client.lanes.ssl_context)  # a key nobody holds: no headers, a clean end
    for _ in range(2):  # twice on one connection
        await lane.send_frame(
            sock,
            kvcache_pb2.LaneFrame(
                request=kvcache_pb2.GetRequest(block_hashes=[bytes(32)], model="m", skip_missing=True, slice_bytes=64)
            ),
        )
        frame, _ = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
        assert frame.WhichOneof("kind") == "end" and frame.end.error == "" and frame.end.code == 0
    sock.close()


async def test_a_write_on_the_bulk_lane_stores_the_good_blocks_and_names_the_bad_ones(cluster) -> None:
    _, _, client, _ = cluster
    info = next(w.info for w in client.registry.workers(common_pb2.ROLE_KVCACHE) if w.worker_id == "kv-2")
    address = info.data_address
    good = chain_blocks(2, seed=7)
    headers = [
        kvcache_pb2.Block(block_hash=b.block_hash, parent_hash=b.parent_hash, layout=layout_to_proto(b.layout))
        for b in good
    ]
    sock = await lane.connect(address, 2.0, client.lanes.ssl_context)
    for _ in range(2):  # twice on one connection: the second time both are already there
        for header, block in zip(headers, good, strict=True):
            await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=header), [block.data])
        await lane.send_frame(sock, kvcache_pb2.LaneFrame(end=common_pb2.LaneEnd()))
        frame, _ = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
        assert frame.WhichOneof("kind") == "put_response"
    assert (frame.put_response.num_stored, frame.put_response.num_present) == (0, 2)
    # a block without a layout and one whose bytes do not match its checksum: rejected, named; the good one kept
    other = chain_blocks(1, seed=8)[0]
    await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=kvcache_pb2.Block(block_hash=bytes(32))), [b"x"])
    bad_sum = kvcache_pb2.Block(
        block_hash=bytes([9]) * 32, parent_hash=ROOT, layout=layout_to_proto(LAYOUT), checksum=1
    )
    await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=bad_sum), [other.data])
    await lane.send_frame(
        sock,
        kvcache_pb2.LaneFrame(
            block=kvcache_pb2.Block(block_hash=other.block_hash, parent_hash=ROOT, layout=layout_to_proto(LAYOUT))
        ),
        [other.data],
    )
    await lane.send_frame(sock, kvcache_pb2.LaneFrame(end=common_pb2.LaneEnd()))
    frame, _ = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
    assert frame.end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert frame.end.error.startswith("rejected 2 block(s), stored 1, already present 0: ")
    assert "has no layout" in frame.end.error
    sock.close()
    stub = client.stub(info.address)
    for keys, num_hits in (([b.block_hash for b in good], 2), ([other.block_hash], 1), ([bytes([9]) * 32], 0)):
        assert (await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=keys, model="m"))).num_hits == num_hits


def test_a_read_plan_takes_data_fragments_then_host_memory_and_ends_at_the_first_short_key() -> None:
    a_ssd, a_host, b_parity, c_data = (
        Source("a", 0, False),
        Source("a", 1, True),
        Source("b", 2, True),
        Source("c", 1, False),
    )
    sources = [
        [b_parity, a_ssd, a_host],  # 2+1: both data fragments, parity unread
        [b_parity, c_data, Source("d", 1, True)],  # fragment 1 twice: the one in host memory; parity fills in
        [Source("e", 0, True)],  # one fragment of a 2+1 block: unreadable, so the plan ends before it
        [a_host, c_data],
    ]
    assert plan_reads(sources, [2, 2, 2, 2]) == [[a_host, a_ssd], [Source("d", 1, True), b_parity]]
    assert plan_reads([[b_parity, a_ssd]], [1]) == [[a_ssd]]  # data on SSD before parity in host memory: no decoding


async def test_priced_protection_codes_dearer_blocks_with_more_parity_on_the_real_store(cluster) -> None:
    _, nodes, client, _ = cluster
    client.priced = PricedProtection.parse("1+0,2+1,1+2", 1.25)  # room for 2+1 on half the blocks
    blocks = chain_blocks(8, seed=3)
    keys = [b.block_hash for b in blocks]
    client.note_prompt(keys, "")  # one prompt: a block's price counts the chain below it, so the head is dearest
    assert client.levels(blocks) == [Protection(2, 1)] * 4 + [Protection(1, 0)] * 4
    await client.put(blocks)
    every = set(nodes)
    expected = [[0, 1, 2]] * 4 + [[0]] * 4  # the fragments each block has on the nodes, by the nodes' own events
    await wait_until(_async(lambda: [sorted(fragments_on(client, k, every).values()) for k in keys] == expected))
    assert [client.index.coding(k) for k in keys] == [Coding(2, 3)] * 4 + [Coding(1, 1)] * 4
    assert await client.fetch("m", keys) == blocks
