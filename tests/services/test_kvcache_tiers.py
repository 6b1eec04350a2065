"""The store's SSD tier: write-through, promotion, a restart that takes the files back, corrupt files; repair plans."""

from __future__ import annotations

import os
from pathlib import Path

from mesh.kv_blocks import checksum
from mesh.kv_index import GlobalKVIndex
from mesh.pb import common_pb2, events_pb2
from services.kvcache.blocks import Block, BlocksRemoved, BlocksStored, Fragment
from services.kvcache.repair import Repairer
from services.kvcache.store import BlockStore, StoreConfig
from services.kvcache.tiers import FileTier

from .test_kvcache import BLOCK_BYTES, LAYOUT, ROOT, Clock, block, chain, key


def ssd_store(path: Path, clock: Clock, host_blocks: int = 2, ssd_blocks: int = 4) -> BlockStore:
    return BlockStore(
        StoreConfig(
            host_capacity_bytes=host_blocks * BLOCK_BYTES,
            ssd_dir=path,
            ssd_capacity_bytes=ssd_blocks * BLOCK_BYTES,
            policy="lru",
            ttl_s={"chat": 1000.0, "agent": 10.0},
        ),
        clock,
    )


def test_blocks_go_through_to_ssd_and_an_ssd_hit_is_promoted(tmp_path: Path) -> None:
    store = ssd_store(tmp_path, Clock())
    result = store.put(chain(1, 2, 3))
    assert result.events == [
        BlocksStored([key(1)], ROOT, 4, "m", "host"),
        BlocksStored([key(1)], ROOT, 4, "m", "ssd"),
        BlocksStored([key(2)], key(1), 4, "m", "host"),
        BlocksStored([key(2)], key(1), 4, "m", "ssd"),
        BlocksRemoved([key(1)], "m", "capacity", "host"),
        BlocksStored([key(3)], key(2), 4, "m", "host"),
        BlocksStored([key(3)], key(2), 4, "m", "ssd"),
    ]
    assert (len(store.host), len(store.ssd)) == (2, 3)  # type: ignore[arg-type]
    found = store.get([key(1), key(2)], "m")  # 1 from SSD evicts 2 from host memory, so 2 comes from SSD too
    assert [(b.block_hash, tier) for b, tier in found.blocks] == [(key(1), "ssd"), (key(2), "ssd")]
    assert found.blocks[0][0].data == block(1).data
    assert found.events == [
        BlocksRemoved([key(2)], "m", "capacity", "host"),
        BlocksStored([key(1)], ROOT, 4, "m", "host"),
        BlocksRemoved([key(3)], "m", "capacity", "host"),
        BlocksStored([key(2)], key(1), 4, "m", "host"),
    ]
    assert [tier for _, tier in store.get([key(1), key(2)], "m").blocks] == ["host", "host"]


def test_a_restarted_node_takes_back_its_files_oldest_first_and_drops_corrupt_ones(tmp_path: Path) -> None:
    clock = Clock()
    store = ssd_store(tmp_path, clock)
    store.put([*chain(1, 2), Block(key(3), ROOT, LAYOUT, bytes([3]) * BLOCK_BYTES, traffic_class="agent")])
    for n, i in enumerate((2, 1, 3)):  # file ages: 2 oldest
        os.utime(store.ssd.path(key(i)), (clock.now - 5 + n, clock.now - 5 + n))  # type: ignore[union-attr]
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "junk.blk").write_bytes(b"not a block")
    clock.now += 6  # the agent block (TTL 10 s) was written 4 s before: it has 4 s left... not yet
    restarted = ssd_store(tmp_path, clock)
    events = restarted.recover()
    assert events == [
        BlocksStored([key(2)], key(1), 4, "m", "ssd"),
        BlocksStored([key(1)], ROOT, 4, "m", "ssd"),
        BlocksStored([key(3)], ROOT, 4, "m", "ssd"),
    ]
    assert not (tmp_path / "zz" / "junk.blk").exists()
    clock.now += 4
    assert restarted.expire() == [BlocksRemoved([key(3)], "m", "ttl", "ssd")]
    assert [b.data for b, _ in restarted.get([key(1), key(2)], "m").blocks] == [block(1).data, block(2).data]
    path = restarted.ssd.path(key(2))  # type: ignore[union-attr]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit on disk
    path.write_bytes(bytes(raw))
    restarted.host.drop(key(2))
    restarted.host.policy.remove(key(2))
    result = restarted.get([key(2)], "m")
    assert (result.blocks, result.events) == ([], [BlocksRemoved([key(2)], "m", "corrupt", "ssd")])


def test_fragments_keep_their_coding_on_disk(tmp_path: Path) -> None:
    tier_store = ssd_store(tmp_path, Clock())
    fragment = Block(
        key(5), ROOT, LAYOUT, bytes(32), fragment=Fragment(2, 2, 3), block_checksum=77, traffic_class="chat"
    )
    tier_store.put([fragment])
    scanned = FileTier(tmp_path, 10**6, tier_store.ssd.policy).scan()  # type: ignore[union-attr]
    assert scanned == [fragment.with_checksum().without_data()]
    assert scanned[0].checksum == checksum(bytes(32))


# --- repair plans ------------------------------------------------------------------------------------------------


class Registry:
    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes

    def workers(self, role: int):
        class W:
            def __init__(self, worker_id: str) -> None:
                self.worker_id = worker_id
                self.info = common_pb2.WorkerInfo(worker_id=worker_id, address=f"{worker_id}:1")

        return [W(n) for n in self.nodes]


def stored(worker: str, seq: int, keys: list[bytes], index: int) -> events_pb2.KVEventBatch:
    event = events_pb2.KVEvent(
        stored=events_pb2.KVBlocksStored(
            block_hashes=keys, fragment_indices=[index] * len(keys), num_data_fragments=2, num_fragments=3
        )
    )
    return events_pb2.KVEventBatch(worker_id=worker, seq=seq, tier="host", events=[event])


def test_the_leader_plans_missing_fragments_onto_live_nodes_without_one(tmp_path: Path) -> None:
    from mesh.placement import rank_nodes

    keys = [bytes([i]) * 32 for i in range(40)]
    # for each key, fragments 0, 1, 2 on its first three nodes in rendezvous order over a, b, c
    index = GlobalKVIndex()
    holders = {key: rank_nodes(key, ["a", "b", "c"]) for key in keys}
    for seq, worker in enumerate(("a", "b", "c"), start=1):
        for fragment in range(3):
            mine = [key for key in keys if holders[key][fragment] == worker]
            index.apply(stored(worker, seq * 10 + fragment, mine, fragment))
    store = BlockStore(StoreConfig(host_capacity_bytes=10**6), Clock())
    store.put([Block(key, ROOT, LAYOUT, bytes(32), fragment=Fragment(holders[key].index("a"), 2, 3)) for key in keys])
    clock = Clock()
    registry = Registry(["a", "b", "c"])
    repairer = Repairer("a", store, index, registry, None, delay_s=5, clock=clock)  # type: ignore[arg-type]
    assert (repairer.plan(), repairer.num_under_protected) == ([], 0)
    registry.nodes = ["a", "b"]  # c is gone: every block c held a fragment of is under-protected, nowhere to go
    assert repairer.plan() == []
    led = [key for key in keys if rank_nodes(key, ["a", "b"])[0] == "a"]
    assert repairer.num_under_protected == len(led) and 0 < len(led) < len(keys)
    registry.nodes = ["a", "b", "d"]  # d replaces c: after the delay, each led block's lost fragment goes to d
    assert repairer.plan() == []
    clock.now += 5
    tasks = repairer.plan()
    assert {t.key for t in tasks} == set(led)
    for task in tasks:
        lost = holders[task.key].index("c")
        assert task.targets == {lost: "d"}
        assert sorted(task.sources) == sorted({0, 1, 2} - {lost})
