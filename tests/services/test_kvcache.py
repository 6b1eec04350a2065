"""The KV store: HostBlockStore's LRU and byte accounting with exact values, then the service on a real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import crc32c
import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import subjects
from mesh.access import PREFILL
from mesh.bus import Bus
from mesh.eviction.policies import LFUDAPolicy, LRUPolicy, S3FIFOPolicy
from mesh.kv_blocks import KVLayout, checksum, layout_to_proto
from mesh.pb import common_pb2, events_pb2, kvcache_pb2, kvcache_pb2_grpc
from services.kvcache.blocks import Fragment
from services.kvcache.codec import block_to_pb
from services.kvcache.config import KVCacheSettings
from services.kvcache.server import serve
from services.kvcache.store import (
    DAY_S,
    Block,
    BlocksRemoved,
    BlocksStored,
    BlockStore,
    StoreConfig,
)
from tests.services.harness import serving

LAYOUT = KVLayout(model="m", dtype="float32", block_size=4, num_layers=2, layer_shape=(1, 2, 4), block_axis=0)
BLOCK_BYTES = 64  # 2 layers x 8 float32
ROOT = b"\0" * 32


def key(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int, parent: int | None = None, layout: KVLayout = LAYOUT) -> Block:
    """Block `i` with key(i), chained after block `parent` (the root when None)."""
    parent_hash = ROOT if parent is None else key(parent)
    return Block(key(i), parent_hash, layout, bytes([i]) * layout.num_block_bytes)


def chain(*ids: int) -> list[Block]:
    return [block(i, None if n == 0 else ids[n - 1]) for n, i in enumerate(ids)]


def lru_store(capacity_bytes: int) -> BlockStore:
    return BlockStore(StoreConfig(host_capacity_bytes=capacity_bytes, policy="lru"))


def held(store: BlockStore, *ids: int) -> list[bool]:
    return [store.lookup([key(i)], "m") == 1 for i in ids]


# --- BlockStore, host memory ------------------------------------------------------------------------------------


def test_the_checksum_is_crc32c() -> None:
    # The check value of CRC-32C (Castagnoli) over "123456789", and a block checked in two pieces
    assert checksum(b"123456789") == 0xE3069283
    assert crc32c.crc32c(b"56789", value=checksum(b"1234")) == 0xE3069283


def test_put_stores_a_chain_as_one_event_and_counts_bytes() -> None:
    store = lru_store(1000)
    result = store.put(chain(1, 2, 3))
    assert (result.num_stored, result.num_present, result.rejections) == (3, 0, [])
    assert result.events == [BlocksStored([key(1), key(2), key(3)], ROOT, 4, "m", "host")]
    stats = store.stats().tiers["host"]
    assert (stats.num_blocks, stats.num_bytes, stats.capacity_bytes) == (3, 3 * BLOCK_BYTES, 1000)


def test_put_of_a_held_block_is_present_and_refreshes_its_recency() -> None:
    store = lru_store(3 * BLOCK_BYTES)
    store.put(chain(1, 2, 3))
    again = store.put([block(1)])
    assert (again.num_stored, again.num_present, again.events) == (0, 1, [])
    result = store.put([block(4, 3)])
    assert result.events == [
        BlocksRemoved([key(2)], "m", "capacity", "host"),
        BlocksStored([key(4)], key(3), 4, "m", "host"),
    ]
    assert store.lookup([key(1)], "m") == 1


def test_get_returns_blocks_in_order_stops_at_the_first_miss_and_uses_a_chain_tail_first() -> None:
    store = lru_store(3 * BLOCK_BYTES)
    store.put(chain(1, 2, 3))
    found = store.get([key(1), key(2), key(9), key(3)], "m")
    assert [(b.block_hash, tier) for b, tier in found.blocks] == [(key(1), "host"), (key(2), "host")]
    assert found.blocks[0][0] == block(1).with_checksum()
    skipping = store.get([key(9), key(3)], "m", skip_missing=True)
    assert [b.block_hash for b, _ in skipping.blocks] == [key(3)]
    # hits are used in reverse: after 1, 2 then 3, the least recent is 2 (a chain's tail before its head)
    events = store.put(chain(4, 5, 6)).events
    assert [e.block_hashes for e in events if isinstance(e, BlocksRemoved)] == [[key(2)], [key(1)], [key(3)]]


def test_lookup_counts_leading_hits_and_leaves_recency_alone() -> None:
    store = lru_store(3 * BLOCK_BYTES)
    store.put(chain(1, 2, 3))
    assert store.lookup([key(1), key(2), key(9), key(3)], "m") == 2
    assert store.lookup([key(9), key(1)], "m") == 0
    assert store.lookup([key(1), key(2), key(3)], "other-model") == 0
    assert store.get([key(1)], "other-model").blocks == []
    result = store.put([block(4, 3)])
    assert result.events[0] == BlocksRemoved([key(1)], "m", "capacity", "host")


def test_a_larger_block_evicts_least_recently_used_blocks_until_it_fits() -> None:
    store = lru_store(3 * BLOCK_BYTES)
    store.put(chain(1, 2, 3))
    wide = KVLayout(model="m", dtype="float32", block_size=4, num_layers=4, layer_shape=(1, 2, 4), block_axis=0)
    result = store.put([block(7, 3, wide)])
    assert result.events == [
        BlocksRemoved([key(1), key(2)], "m", "capacity", "host"),
        BlocksStored([key(7)], key(3), 4, "m", "host"),
    ]
    assert store.stats().tiers["host"].num_bytes == 3 * BLOCK_BYTES


def test_bad_blocks_are_rejected_with_a_reason_and_the_others_kept() -> None:
    store = lru_store(2 * BLOCK_BYTES)
    huge = KVLayout(model="m", dtype="float32", block_size=4, num_layers=6, layer_shape=(1, 2, 4), block_axis=0)
    bad = [
        Block(b"", ROOT, LAYOUT, bytes(BLOCK_BYTES)),
        Block(key(5), ROOT, LAYOUT, b""),
        Block(key(6), ROOT, LAYOUT, bytes(10)),
        Block(key(7), ROOT, KVLayout("m", "int8", 4, 2, (1, 2, 4), 0), bytes(16)),
        block(8, None, huge),
        Block(key(9), ROOT, LAYOUT, bytes(BLOCK_BYTES), checksum=12345),
        Block(key(10), ROOT, LAYOUT, bytes(BLOCK_BYTES), fragment=Fragment(3, 2, 3)),
        Block(key(11), ROOT, LAYOUT, bytes(BLOCK_BYTES), fragment=Fragment(1, 2, 3)),
    ]
    result = store.put(
        [bad[0], bad[1], block(1), *bad[2:], Block(key(12), ROOT, LAYOUT, bytes(32), fragment=Fragment(2, 2, 3))]
    )
    assert result.rejections == [
        "a block has an empty block_hash",
        f"block {key(5).hex()[:16]} has no data",
        f"block {key(6).hex()[:16]} has 10 bytes, its layout says 64",
        f"block {key(7).hex()[:16]} has an unknown dtype 'int8'",
        f"block {key(8).hex()[:16]} has 192 bytes, more than the store's 128",
        f"block {key(9).hex()[:16]} fails its checksum",
        f"block {key(10).hex()[:16]} has a bad fragment 3 of 2+1",
        f"block {key(11).hex()[:16]} has 64 bytes, a fragment of its layout has 32",
    ]
    assert result.num_stored == 2
    assert store.fragment_indices([key(1), key(12), key(11)], "m") == [0, 2, -1]


# --- eviction policies: exact orders ----------------------------------------------------------------------------


def k(i: int) -> bytes:
    return bytes([i])


def drain(policy) -> list[int]:
    order = []
    while (victim := policy.victim()) is not None:
        order.append(victim[0])
    return order


def test_lru_evicts_least_recently_used_first() -> None:
    policy = LRUPolicy()
    for i in (1, 2, 3, 4):
        policy.insert(k(i), 1)
    policy.touch(k(2))
    policy.touch(k(1))
    policy.remove(k(4))
    assert drain(policy) == [3, 2, 1]


def test_s3fifo_sends_one_hit_wonders_out_through_the_small_queue_and_keeps_reused_keys() -> None:
    policy = S3FIFOPolicy(capacity_bytes=10)  # small queue target: 1 byte
    for i in (1, 2, 3):
        policy.insert(k(i), 1)
    policy.touch(k(2))
    # 1 leaves (no hit, to the ghost), 2 moves to main (hit), 3 leaves, then main gives up 2
    assert [policy.victim(), policy.victim()] == [k(1), k(3)]
    policy.insert(k(1), 1)  # a ghost comes back: straight to main, behind 2
    policy.touch(k(2))
    assert drain(policy) == [1, 2]  # 2 had a hit in main: one more lap


def test_lfuda_evicts_by_hits_with_aging_oldest_first_among_equals() -> None:
    policy = LFUDAPolicy()
    for i in (1, 2, 3):
        policy.insert(k(i), 1)
    policy.touch(k(1))
    policy.touch(k(1))  # priority 3
    policy.touch(k(2))  # priority 2
    assert policy.victim() == k(3)  # priority 1: the floor is now 1
    policy.insert(k(4), 1)  # priority 1 + 1 = 2, newer than 2
    assert drain(policy) == [2, 4, 1]


# --- TTL by traffic class, pins ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def classed(i: int, traffic_class: str) -> Block:
    return Block(key(i), ROOT, LAYOUT, bytes([i]) * BLOCK_BYTES, traffic_class=traffic_class)


def test_blocks_expire_by_their_traffic_class_and_use_pushes_the_deadline_back() -> None:
    clock = Clock()
    store = BlockStore(StoreConfig(host_capacity_bytes=10 * BLOCK_BYTES), clock)
    store.put([classed(1, "agent"), classed(2, "chat"), classed(3, ""), classed(4, "unknown")])
    clock.now += 3 * DAY_S - 1
    assert store.expire() == []
    store.get([key(2)], "m")  # chat: 7 days from now
    clock.now += 1
    assert store.expire() == [BlocksRemoved([key(1)], "m", "ttl", "host")]
    assert held(store, 1, 2, 3, 4) == [False, True, True, True]
    clock.now += 4 * DAY_S  # 3 and 4 (default class chat) were put 7 days ago
    assert store.expire() == [BlocksRemoved([key(3), key(4)], "m", "ttl", "host")]
    clock.now += 3 * DAY_S - 1
    assert store.expire() == [BlocksRemoved([key(2)], "m", "ttl", "host")]


def test_pins_survive_eviction_and_ttl_until_they_expire() -> None:
    clock = Clock()
    store = BlockStore(StoreConfig(host_capacity_bytes=2 * BLOCK_BYTES, policy="lru", ttl_s={"chat": 100.0}), clock)
    store.put(chain(1, 2))
    assert store.pin([key(1), key(9)], "m", ttl_s=500) == 1  # 9 is not held
    result = store.put([block(3, 2)])  # 1 is the least recently used, but pinned: 2 goes
    assert result.events[0] == BlocksRemoved([key(2)], "m", "capacity", "host")
    clock.now += 200
    assert store.expire() == [BlocksRemoved([key(3)], "m", "ttl", "host")]  # 1's TTL ran out too, but it is pinned
    store.put([block(4)])
    assert store.pin([key(4)], "m", ttl_s=50) == 1
    assert store.put([block(5)]).rejections == [f"block {key(5).hex()[:16]}: no room (every block is pinned)"]
    assert store.stats().num_pinned == 2
    clock.now += 51
    assert store.expire() == []  # 4's pin ended: its TTL starts over (100 s)
    clock.now += 250
    assert store.expire() == [BlocksRemoved([key(4)], "m", "ttl", "host")]  # and 1's pin ended
    assert store.stats().num_pinned == 0
    clock.now += 100
    assert store.expire() == [BlocksRemoved([key(1)], "m", "ttl", "host")]


# --- the service on a real NATS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")) as nats:
        yield nats.url


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def collect(bus: Bus, subject: str, message_type: type) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    async def on_message(message: object, _: str) -> None:
        queue.put_nowait(message)

    await bus.subscribe(subject, message_type, on_message)
    return queue


async def test_service_puts_gets_looks_up_publishes_events_and_heartbeats(nats_url: str) -> None:
    settings = KVCacheSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id="kv-test",
        heartbeat_interval_s=0.2,
        capacity_bytes=3 * BLOCK_BYTES,
    )
    bus = await Bus.connect(nats_url, name="test")
    batches = await collect(bus, subjects.kv_events("kv-test"), events_pb2.KVEventBatch)
    beats = await collect(bus, subjects.heartbeat("kvcache"), events_pb2.WorkerHeartbeat)
    evictions_before = sample("kvmesh_kvcache_evictions_total", reason="capacity")
    hits_before = sample("kvmesh_kvcache_lookup_blocks_total", outcome="hit")
    misses_before = sample("kvmesh_kvcache_lookup_blocks_total", outcome="miss")
    async with serving(serve, settings, PREFILL) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        no_layout = kvcache_pb2.Block(block_hash=key(8), parent_hash=ROOT, data=bytes(BLOCK_BYTES))
        empty = kvcache_pb2.Block(block_hash=key(9), parent_hash=ROOT, layout=layout_to_proto(LAYOUT))
        stream = [block_to_pb(b) for b in chain(1, 2, 3)]
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Put(iter([stream[0], no_layout, stream[1], empty, stream[2]]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == (
            f"rejected 2 block(s), stored 3, already present 0: block "
            f"{key(8).hex()[:16]} has no layout; block {key(9).hex()[:16]} has no data"
        )
        cleared = await asyncio.wait_for(batches.get(), 5)  # a node starts by saying it holds nothing yet
        assert (cleared.seq, list(cleared.events)) == (1, [events_pb2.KVEvent(all_cleared=True)])
        first = await asyncio.wait_for(batches.get(), 5)
        assert (first.worker_id, first.seq, first.tier) == ("kv-test", 2, "host")
        assert list(first.events) == [
            events_pb2.KVEvent(
                stored=events_pb2.KVBlocksStored(
                    block_hashes=[key(1), key(2), key(3)], parent_hash=ROOT, block_size=4, model="m"
                )
            )
        ]

        lookup = await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[key(1), key(2), key(3), key(4)], model="m"))
        assert lookup.num_hits == 3
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Lookup(kvcache_pb2.LookupRequest(block_hashes=[key(1)]))
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "model is required (a block of another model never matches)",
        )
        got = [b async for b in stub.Get(kvcache_pb2.GetRequest(block_hashes=[key(2), key(1), key(4)], model="m"))]
        # with the CRC-32C the node computed, and the tier it came from
        assert got == [block_to_pb(block(2, 1).with_checksum(), "host"), block_to_pb(block(1).with_checksum(), "host")]
        assert got[0].checksum == crc32c.crc32c(block(2, 1).data)

        put = await stub.Put(iter([block_to_pb(block(4, 3))]))
        assert (put.num_stored, put.num_present) == (1, 0)
        second = await asyncio.wait_for(batches.get(), 5)
        assert (second.seq, [e.WhichOneof("event") for e in second.events]) == (3, ["removed", "stored"])
        assert list(second.events[0].removed.block_hashes) == [key(3)]  # 1 and 2 were read after 3
        assert (list(second.events[1].stored.block_hashes), second.events[1].stored.parent_hash) == ([key(4)], key(3))

        async def cached_three() -> events_pb2.WorkerHeartbeat:
            while True:
                beat = await beats.get()
                if beat.worker.worker_id == "kv-test" and beat.load.num_cached_blocks == 3:
                    return beat

        beat = await asyncio.wait_for(cached_three(), 5)
        assert beat.worker.role == common_pb2.ROLE_KVCACHE
        assert beat.worker.address == f"127.0.0.1:{settings.grpc_port}"
        assert sample("kvmesh_kvcache_blocks", tier="host") == 3
        assert sample("kvmesh_kvcache_bytes", tier="host") == 3 * BLOCK_BYTES
        assert sample("kvmesh_kvcache_evictions_total", reason="capacity") - evictions_before == 1
        assert sample("kvmesh_kvcache_lookup_blocks_total", outcome="hit") - hits_before == 5
        assert sample("kvmesh_kvcache_lookup_blocks_total", outcome="miss") - misses_before == 2
    last = await asyncio.wait_for(_last_beat_of(beats, "kv-test"), 5)
    assert last.leaving
    await bus.close()


async def _last_beat_of(beats: asyncio.Queue, worker_id: str) -> events_pb2.WorkerHeartbeat:
    """The `leaving` heartbeat a graceful stop sends (earlier ones are skipped)."""
    while True:
        beat = await beats.get()
        if beat.worker.worker_id == worker_id and beat.leaving:
            return beat
