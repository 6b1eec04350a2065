"""Compaction of the KV event stream over a real NATS: snapshots of the global index restore it exactly, a follower
that starts after a compaction replays only the tail, one that falls behind a purge restores the newer snapshot,
and two compactors racing leave one snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from kvmesh.nats_server import EmbeddedNats
from mesh import kv_snapshot, subjects
from mesh.bus import Bus
from mesh.kv_index import STORE_TIERS, GlobalKVIndex
from mesh.kv_stream import STREAM, KVEventFollower, KVIndexCompactor, ensure_kv_stream
from mesh.pb import events_pb2

STORE_ONLY = frozenset({"host", "ssd"})


def key(n: int) -> bytes:
    return n.to_bytes(4, "big") * 8


def stored(keys: list[int], fragments: list[int] | None = None) -> events_pb2.KVEvent:
    if fragments is None:
        return events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[key(n) for n in keys]))
    return events_pb2.KVEvent(
        stored=events_pb2.KVBlocksStored(
            block_hashes=[key(n) for n in keys], fragment_indices=fragments, num_data_fragments=2, num_fragments=3
        )
    )


def removed(keys: list[int]) -> events_pb2.KVEvent:
    return events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=[key(n) for n in keys]))


def history(rounds: int) -> Iterator[events_pb2.KVEventBatch]:
    """Churn from three workers: a prefill worker's device cache, a store node's host and SSD tiers (one seq across
    both, erasure-coded fragments) and a second store node that restarts midway (its seq starts over)."""
    seqs = {"prefill-1": 0, "kv-1": 0, "kv-2": 0}

    def batch(worker: str, tier: str, *events: events_pb2.KVEvent) -> events_pb2.KVEventBatch:
        seqs[worker] += 1
        return events_pb2.KVEventBatch(worker_id=worker, seq=seqs[worker], tier=tier, events=events)

    for r in range(rounds):
        base = 10 * r
        yield batch("prefill-1", "device", stored([base, base + 1, base + 2]))
        if r >= 2:
            yield batch("prefill-1", "device", removed([base - 20, base - 19]))
        yield batch("kv-1", "host", stored([base, base + 1], fragments=[r % 3, (r + 1) % 3]))
        yield batch("kv-1", "ssd", stored([base]))
        if r % 3 == 2:
            yield batch("kv-1", "host", removed([base - 10]))
        if r == rounds // 2:
            seqs["kv-2"] = 0  # a restart: all_cleared, then what its SSD still holds
            yield batch("kv-2", "", events_pb2.KVEvent(all_cleared=True))
            yield batch("kv-2", "ssd", stored([base + 5]))
        else:
            yield batch("kv-2", "host", stored([base + 3, base + 4], fragments=[2, 0]))


def holdings(index: GlobalKVIndex) -> dict[str, dict[bytes, tuple[int, int]]]:
    """Worker -> key -> (fragment, tier mask): everything a read can see, without the batch numbering."""
    snapshot = index.to_snapshot(0)
    return {
        w.worker_id: dict(zip(w.block_hashes, zip(w.fragment_indices, w.tier_masks, strict=True), strict=True))
        for w in snapshot.workers
        if w.block_hashes
    }


def replayed(batches: list[events_pb2.KVEventBatch], tiers: frozenset[str] | None = None) -> GlobalKVIndex:
    """What a follower's own replay of `batches` builds (its tier filter included)."""
    index = GlobalKVIndex()
    for batch in batches:
        if tiers is None or batch.tier in tiers or not batch.tier:
            index.apply(batch)
    return index


def test_a_snapshot_restores_the_index_exactly() -> None:
    batches = list(history(12))
    index = replayed(batches)
    snapshot = index.to_snapshot(len(batches))
    restored = GlobalKVIndex()
    restored.add("stale", [key(999)])  # what was there before goes
    restored.restore(events_pb2.KVIndexSnapshot.FromString(snapshot.SerializeToString()))
    assert restored.to_snapshot(len(batches)) == snapshot
    assert holdings(restored) == holdings(index) and restored.holders(key(999)) == {}
    assert restored.coding(key(110)) == index.coding(key(110)) and restored.coding(key(110)).num_total == 3
    assert {w.worker_id: w.last_seq for w in snapshot.workers} == {"prefill-1": 22, "kv-1": 28, "kv-2": 7}

    # Restored for a store-tiers follower: the same as that follower's own replay, and the batch numbering goes on.
    store_view = GlobalKVIndex()
    store_view.restore(snapshot, STORE_TIERS)
    assert holdings(store_view) == holdings(replayed(batches, STORE_ONLY))
    following = events_pb2.KVEventBatch(worker_id="kv-1", seq=29, tier="host", events=[stored([500])])
    assert store_view.apply(following) == 0 and store_view.holds("kv-1", key(500))


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path / "nats") as nats:
        yield nats.url


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(nats_url, "test-kv-snapshot")
    assert await ensure_kv_stream(bus)
    yield bus
    await bus.close()


async def publish(bus: Bus, batches: list[events_pb2.KVEventBatch]) -> None:
    js = bus.client.jetstream()
    for batch in batches:
        await js.publish(subjects.kv_events(batch.worker_id), batch.SerializeToString())


async def caught_up_to(follower: KVEventFollower, seq: int) -> None:
    for _ in range(500):
        if follower.last_stream_seq >= seq and follower.is_caught_up:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"follower at {follower.last_stream_seq}, not {seq}")


async def stream_state(bus: Bus) -> tuple[int, int]:
    """(first seq, messages) of KVMESH_KV."""
    info = await bus.client.jetstream().stream_info(STREAM)
    return int(info.state.first_seq), int(info.state.messages)


async def snapshot_objects(bus: Bus) -> list[str]:
    objects = await bus.client.jetstream().object_store(kv_snapshot.OBJECTS)
    try:
        listed = await objects.list(ignore_deletes=True)
    except NotFoundError:  # nats-py's answer for an empty store
        return []
    return sorted(info.name.rsplit("-", 1)[0] for info in listed)  # index-<seq>, without the writer's own id


async def test_a_follower_that_starts_after_compaction_replays_only_the_tail(bus: Bus) -> None:
    batches = list(history(16))
    head, tail = batches[:30], batches[30:]
    await publish(bus, head)
    full = KVEventFollower(bus, GlobalKVIndex())
    await full.start()
    await caught_up_to(full, 30)
    compactor = KVIndexCompactor(full, every=30)
    assert compactor.due() and await compactor.compact()
    assert (await stream_state(bus), await kv_snapshot.latest_seq(bus)) == ((31, 0), 30)
    assert not compactor.due()  # not until another 30 messages
    await publish(bus, tail)
    await caught_up_to(full, len(batches))

    late, store_side = KVEventFollower(bus, GlobalKVIndex()), KVEventFollower(bus, GlobalKVIndex(), STORE_ONLY)
    for follower in (late, store_side):
        await follower.start()
        await caught_up_to(follower, len(batches))
    assert (late.num_restores, late.num_replayed, late.num_lost) == (1, len(tail), 0)
    assert holdings(late.index) == holdings(full.index) == holdings(replayed(batches))
    assert holdings(store_side.index) == holdings(replayed(batches, STORE_ONLY))
    assert compactor.due() and len(tail) >= 30
    for follower in (full, late, store_side):
        await follower.stop()


async def test_a_follower_behind_a_purge_restores_the_newer_snapshot(bus: Bus, monkeypatch) -> None:
    batches = list(history(16))
    await publish(bus, batches[:10])
    full = KVEventFollower(bus, GlobalKVIndex())
    await full.start()
    await caught_up_to(full, 10)
    compactor = KVIndexCompactor(full, every=10)
    assert await compactor.compact()
    older = await kv_snapshot.load_latest(bus)
    await publish(bus, batches[10:30])
    await caught_up_to(full, 30)
    assert await compactor.compact()
    assert await snapshot_objects(bus) == ["index-30"]  # the older snapshot's object went with its messages

    # A follower that read the pointer just before the second compaction: it restores seq 10 and asks for 11 on.
    handed_out: list[int] = []

    async def racing(bus: Bus, create: bool = True) -> events_pb2.KVIndexSnapshot | None:
        snapshot = older if not handed_out else await load_latest(bus, create=create)
        handed_out.append(snapshot.stream_seq if snapshot else 0)
        return snapshot

    load_latest = kv_snapshot.load_latest
    monkeypatch.setattr(kv_snapshot, "load_latest", racing)
    behind = KVEventFollower(bus, GlobalKVIndex())
    await behind.start()
    await publish(bus, batches[30:])  # the first message it gets is 31: 11-30 were purged
    await caught_up_to(behind, len(batches))
    await caught_up_to(full, len(batches))
    assert handed_out == [10, 30] and (behind.num_restores, behind.num_lost) == (2, 0)
    assert holdings(behind.index) == holdings(full.index) == holdings(replayed(batches))
    await behind.stop()
    await full.stop()


async def test_two_compactors_racing_leave_one_snapshot(bus: Bus) -> None:
    batches = list(history(8))
    await publish(bus, batches)
    followers = [KVEventFollower(bus, GlobalKVIndex()) for _ in range(2)]
    for follower in followers:
        await follower.start()
        await caught_up_to(follower, len(batches))
    compactors = [KVIndexCompactor(follower, every=5) for follower in followers]
    won = await asyncio.gather(*(compactor.compact() for compactor in compactors))
    assert sorted(won) == [False, True]
    assert await snapshot_objects(bus) == [f"index-{len(batches)}"]
    assert [c.snapshot_seq for c in compactors] == [len(batches)] * 2
    assert await stream_state(bus) == (len(batches) + 1, 0)
    for follower in followers:
        await follower.stop()


def test_only_a_follower_of_every_tier_compacts(bus: Bus) -> None:
    with pytest.raises(ValueError, match="every tier"):
        KVIndexCompactor(KVEventFollower(bus, GlobalKVIndex(), STORE_ONLY), every=10)
    with pytest.raises(ValueError, match="at least 1"):
        KVIndexCompactor(KVEventFollower(bus, GlobalKVIndex()), every=0)
