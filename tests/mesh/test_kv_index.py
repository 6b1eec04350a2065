"""The global KV index from event batches: holders by tier and fragment, removal per tier, restarts, replay."""

from __future__ import annotations

from mesh.kv_index import Coding, GlobalKVIndex, Holding
from mesh.pb import events_pb2


def k(i: int) -> bytes:
    return bytes([i]) * 32


def batch(worker: str, seq: int, tier: str, *events: events_pb2.KVEvent) -> events_pb2.KVEventBatch:
    return events_pb2.KVEventBatch(worker_id=worker, seq=seq, tier=tier, events=events)


def stored(*ids: int, fragments: list[int] | None = None) -> events_pb2.KVEvent:
    coded = dict(fragment_indices=fragments, num_data_fragments=2, num_fragments=3) if fragments else {}
    return events_pb2.KVEvent(stored=events_pb2.KVBlocksStored(block_hashes=[k(i) for i in ids], **coded))


def removed(*ids: int) -> events_pb2.KVEvent:
    return events_pb2.KVEvent(removed=events_pb2.KVBlocksRemoved(block_hashes=[k(i) for i in ids]))


def test_holders_follow_stored_and_removed_per_tier_and_fragment() -> None:
    index = GlobalKVIndex()
    assert index.apply(batch("kv-0", 1, "host", stored(1, 2, fragments=[0, 2]))) == 0
    index.apply(batch("kv-0", 2, "ssd", stored(1, 2, fragments=[0, 2])))
    index.apply(batch("kv-1", 1, "host", stored(1, fragments=[1])))
    index.apply(batch("prefill-0", 1, "device", stored(1, 3)))
    assert index.holders(k(1)) == {"kv-0": Holding(0, 2 | 4), "kv-1": Holding(1, 2), "prefill-0": Holding(0, 1)}
    assert index.coding(k(1)) == Coding(2, 3) and index.coding(k(3)) == Coding(1, 1)
    assert index.num_readable(k(1), ["kv-0", "kv-1"]) == 2 and index.num_readable(k(1), ["kv-1"]) == 1
    index.apply(batch("kv-0", 3, "host", removed(1)))
    assert index.holders(k(1))["kv-0"] == Holding(0, 4) and index.holders(k(1))["kv-0"].has_tier("ssd")
    index.apply(batch("kv-0", 4, "ssd", removed(1)))
    assert set(index.holders(k(1))) == {"kv-1", "prefill-0"}
    assert index.num_leading_hits("prefill-0", [k(1), k(3), k(2)]) == 2
    assert (index.num_blocks(), index.num_blocks("kv-0")) == (3, 1)


def test_gaps_are_counted_and_a_restarted_worker_starts_over() -> None:
    index = GlobalKVIndex()
    index.apply(batch("kv-0", 1, "host", stored(1)))
    assert index.apply(batch("kv-0", 4, "host", stored(2))) == 2
    assert index.apply(batch("kv-0", 1, "host", stored(3))) == 0  # seq went back: a new process
    assert index.keys_of("kv-0") == [k(3)]
    index.apply(batch("kv-0", 2, "", events_pb2.KVEvent(all_cleared=True)))
    assert index.num_blocks() == 0 and index.num_missed_batches == 2
    index.apply(batch("kv-1", 1, "host", stored(5)))
    index.drop("kv-1")
    assert index.holders(k(5)) == {}


def test_replaying_the_same_batches_builds_the_same_index() -> None:
    batches = [batch(f"kv-{n % 3}", n // 3 + 1, "host", stored(n + 1, n + 2), removed(n)) for n in range(60)]
    first, second = GlobalKVIndex(), GlobalKVIndex()
    for b in batches:
        first.apply(b)
    for b in batches:
        second.apply(events_pb2.KVEventBatch.FromString(b.SerializeToString()))
    assert [first.holders(k(i)) for i in range(62)] == [second.holders(k(i)) for i in range(62)]
    # kv-0 stored n+1, n+2 for n = 0, 3, ..., 57 and removed only multiples of 3, which it never stored
    assert sorted(first.keys_of("kv-0")) == sorted(k(n + d) for n in range(0, 60, 3) for d in (1, 2))
